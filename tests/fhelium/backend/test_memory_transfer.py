"""`fhelium_memory.transfer` through the Backend: CPU, pinned host, and CUDA where present."""

from __future__ import annotations

import pytest
import torch

from fhelium.backend import BoundResource, OperationBackend, ResourceError, default_registry
from fhelium.backend.implementation import ImplementationError
from fhelium.backend.memory import bind_device, pinned_memory_available, transfer_tensor
from fhelium.ir import Program
from tests.conftest import require_capability

T = "tensor<8xi64>"


def _transfer_program(memory_space: str | None) -> Program:
    attribute = "" if memory_space is None else f' {{memory_space = "{memory_space}"}}'
    return Program.parse(
        f"""builtin.module {{
  func.func @main(%x: {T}) -> {T} {{
    %d = "fhelium.resource.ref"() {{symbol = "target", kind = "execution-device"}}
        : () -> !fhelium_memory.device
    %y = "fhelium_memory.transfer"(%x, %d){attribute} : ({T}, !fhelium_memory.device) -> {T}
    func.return %y : {T}
  }}
}}
"""
    )


def _run(memory_space: str | None, value: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    backend = OperationBackend(default_registry(), [bind_device("target", device)])
    (out,) = backend.link(_transfer_program(memory_space)).run(value)
    assert isinstance(out, torch.Tensor)
    return out


def test_same_device_default_transfer_returns_the_input_storage() -> None:
    value = torch.arange(8)
    out = _run(None, value)
    assert out.data_ptr() == value.data_ptr()
    assert _run("default", value).data_ptr() == value.data_ptr()


def test_pageable_host_transfer_of_a_cpu_tensor_stays_pageable() -> None:
    value = torch.arange(8)
    out = _run("pageable_host", value)
    assert out.device.type == "cpu" and not out.is_pinned()
    assert torch.equal(out, value)


def test_pinned_host_transfer_allocates_pinned_storage() -> None:
    require_capability(
        "pinned_memory", pinned_memory_available(), "PyTorch has no pinned-memory allocator here"
    )
    value = torch.arange(8)
    out = _run("pinned_host", value)
    assert out.is_pinned() and torch.equal(out, value)
    assert out.data_ptr() != value.data_ptr()
    again = transfer_tensor(out, torch.device("cpu"), "pinned_host")
    assert again.data_ptr() == out.data_ptr()
    pageable = transfer_tensor(out, torch.device("cpu"), "pageable_host")
    assert not pageable.is_pinned() and torch.equal(pageable, value)


def test_pinned_host_without_allocator_fails_with_a_clear_error() -> None:
    if pinned_memory_available():
        pytest.skip("this runtime has a pinned-memory allocator; the error path cannot occur")
    with pytest.raises(ImplementationError, match="Pinned host storage is unavailable"):
        _run("pinned_host", torch.arange(8))


def test_host_memory_spaces_require_a_cpu_target() -> None:
    with pytest.raises(ImplementationError, match="Memory space 'pinned_host' requires a CPU target device"):
        transfer_tensor(torch.arange(8), torch.device("cuda:0"), "pinned_host")


def test_cuda_device_resource_needs_a_concrete_index() -> None:
    with pytest.raises(ValueError, match="concrete CUDA index"):
        bind_device("target", "cuda")


def test_transfer_target_must_be_a_device_resource() -> None:
    wrong = BoundResource("target", "process-group", object())
    with pytest.raises(ResourceError, match="kind 'process-group'; required 'execution-device'"):
        OperationBackend(default_registry(), [wrong]).link(_transfer_program(None))


@pytest.mark.gpu
def test_cuda_round_trip_through_transfers() -> None:
    require_capability("gpu", torch.cuda.is_available(), "no CUDA device")
    value = torch.arange(8)
    on_gpu = _run(None, value, "cuda:0")
    assert on_gpu.device == torch.device("cuda:0") and torch.equal(on_gpu.cpu(), value)
    back = _run("pinned_host", on_gpu, "cpu")
    assert back.is_pinned() and torch.equal(back, value)
    same = _run(None, on_gpu, "cuda:0")
    assert same.data_ptr() == on_gpu.data_ptr()
