from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from flodld.config.devices import DeviceSpec, rank_labels, spec_has_cpu, spec_rank_count

SPEC: TypeAdapter[DeviceSpec] = TypeAdapter(DeviceSpec)


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ([0, 1], ("cuda:0", "cuda:1")),
        (["cuda:3", 0], ("cuda:3", "cuda:0")),
        (["cpu"], ("cpu",)),
        (["cpu:1"], ("cpu",)),
        (["CPU:4"], ("cpu:4",)),
        ([" cuda:2 "], ("cuda:2",)),
        ("all", "all"),
    ],
)
def test_written_devices_normalise_to_canonical_entries(written: object, canonical: object) -> None:
    assert SPEC.validate_python(written) == canonical


@pytest.mark.parametrize(
    ("written", "fragment"),
    [
        ([], "list is empty"),
        ([0, "cuda:0"], "cuda:0 is listed twice"),
        (["cpu:0"], "zero CPU ranks"),
        (["gpu0"], '"cpu:K"'),
        ([256], "out of range"),
        ([-1], "out of range"),
        ([True], "not a device"),
        (["all"], "replaces the whole list"),
        ("cpu:4", "write it as a list"),
        ("everything", 'expected "all" or a list'),
        (["cpu:5000"], "at most"),
    ],
)
def test_bad_devices_are_refused_with_the_accepted_forms(written: object, fragment: str) -> None:
    with pytest.raises(ValidationError) as caught:
        SPEC.validate_python(written)
    assert fragment in str(caught.value)


def test_rank_labels_keep_cuda_ids_and_number_cpu_ranks_per_host() -> None:
    entries = SPEC.validate_python([1, "cpu:2", 0, "cpu"])
    assert isinstance(entries, tuple)
    assert rank_labels(entries) == ["cuda:1", "cpu:0", "cpu:1", "cuda:0", "cpu:2"]


def test_rank_count_is_unknown_for_all_and_summed_for_lists() -> None:
    assert spec_rank_count("all") is None
    assert spec_rank_count(SPEC.validate_python([0, "cpu:3"])) == 4
    assert spec_has_cpu(SPEC.validate_python([0, "cpu"]))
    assert not spec_has_cpu(SPEC.validate_python([0]))
    assert not spec_has_cpu("all")
