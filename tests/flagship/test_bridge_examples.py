"""The short example programs on the bridge (flodld_fhelium) under `fdl run`, on both roads.

examples/encrypted_aggregation.py spells out the single-key workload with the bridge's pieces;
examples/threshold_aggregation.py averages a model's gradients with no key holder through the
bridge's share channel. Each is a plain program file: it finds the bridge as an installed package
(no sys.path tricks), as a user's program would.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.harness import Fdl

pytestmark = pytest.mark.multiproc

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("transport", ["relay", "process-group"])
def test_the_single_key_example_decrypts_the_mean_on_the_key_holder(transport: str) -> None:
    run = Fdl(
        "run", "--ranks", "2", str(EXAMPLES / "encrypted_aggregation.py"), "--",
        "--values", "4096", "--transport", transport,
    )  # fmt: skip
    assert run.wait(240) == 0, run.output
    verdicts = re.findall(r"rank 0/2: encrypted sum PASS: mean's max error (\S+) \((\S+)\)", run.output)
    assert [name for _, name in verdicts] == [transport], run.output
    assert float(verdicts[0][0]) < 1e-6
    assert "rank 1/2: encrypted 4096 values into" in run.output  # rank 1 holds no key: it only encrypts


@pytest.mark.parametrize("transport", ["relay", "process-group"])
def test_the_threshold_example_trains_with_every_rank_decrypting_the_same_mean(transport: str) -> None:
    run = Fdl(
        "run", "--ranks", "3", str(EXAMPLES / "threshold_aggregation.py"), "--",
        "--steps", "2", "--transport", transport,
    )  # fmt: skip
    assert run.wait(240) == 0, run.output
    verdicts = re.findall(r"rank (\d)/3: threshold aggregation PASS: max error (\S+) \((\S+)\)", run.output)
    assert sorted(rank for rank, _, _ in verdicts) == ["0", "1", "2"], run.output
    assert {name for _, _, name in verdicts} == {transport}
    assert len({error for _, error, _ in verdicts}) == 1  # every rank decrypted the same sums
    assert all(float(error) < 1e-6 for _, error, _ in verdicts)
    assert len(re.findall(r"step 1: encrypted mean of 65 gradients", run.output)) == 3


@pytest.mark.parametrize(
    "example", ["encrypted_mean.py", "encrypted_aggregation.py", "threshold_aggregation.py"]
)
def test_each_example_is_a_short_program_on_the_bridge(example: str) -> None:
    source = (EXAMPLES / example).read_text()
    assert len(source.splitlines()) < 200
    assert "flodld_fhelium" in source and "sys.path" not in source
