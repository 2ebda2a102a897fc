"""TensorResident: the device/storage behaviour shared by every value that owns tensors."""

from __future__ import annotations

from abc import ABC
from dataclasses import Field, replace
from typing import Any, ClassVar, Self

import torch

from fhelium.core.errors import FheliumValueError


class TensorResident(ABC):
    """A value (a dataclass) whose payload is one or more tensors on one common device.

    ``TENSOR_FIELDS`` names the fields that hold them, in serialization order; a field that is None
    holds none (a Plaintext's message or data, a CompressedPlaintext's implicit_data).
    """

    TENSOR_FIELDS: ClassVar[tuple[str, ...]]
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # every subclass is a dataclass

    def metadata_equal(self, other: Self) -> bool:
        """Every field but the tensors equal (what stacking values into one batch needs)."""
        names = [name for name in self.__dataclass_fields__ if name not in self.TENSOR_FIELDS]
        return all(getattr(self, name) == getattr(other, name) for name in names)

    def _tensor_fields(self) -> tuple[str, ...]:
        return tuple(name for name in self.TENSOR_FIELDS if getattr(self, name) is not None)

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors this value owns, in serialization order."""
        return tuple(getattr(self, name) for name in self._tensor_fields())

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Self:
        """The same value with its tensors replaced (same order as ``_resident_tensors``)."""
        names = self._tensor_fields()
        if len(tensors) != len(names):
            raise FheliumValueError(f"{type(self).__name__} holds {len(names)} tensors; got {len(tensors)}")
        return replace(self, **dict(zip(names, tensors, strict=True)))

    @property
    def device(self) -> torch.device:
        devices = {t.device for t in self._resident_tensors}
        if len(devices) != 1:
            raise FheliumValueError(
                f"{type(self).__name__} tensors do not share one device: {sorted(map(str, devices))}"
            )
        return devices.pop()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._resident_tensors)

    @property
    def storage_nbytes(self) -> int:
        seen: dict[int, int] = {}
        for t in self._resident_tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def to(self, device: torch.device | str, *, non_blocking: bool = False, copy: bool = False) -> Self:
        target = torch.device(device)
        tensors = self._resident_tensors
        if not copy and all(t.device == target for t in tensors):
            return self
        moved = tuple(t.to(target, non_blocking=non_blocking, copy=copy) for t in tensors)
        return self._with_resident_tensors(moved)

    def cpu(self, *, copy: bool = False) -> Self:
        return self.to("cpu", copy=copy)

    @property
    def is_pinned(self) -> bool:
        return all(t.device.type == "cpu" and t.is_pinned() for t in self._resident_tensors)

    def pin_memory(self, *, copy: bool = False) -> Self:
        """Page-locked host copies of every tensor (``self`` when already pinned and not copying)."""
        if self.is_pinned and not copy:
            return self
        try:
            pinned = tuple(t.cpu().pin_memory() for t in self._resident_tensors)
        except RuntimeError as error:
            raise FheliumValueError(
                f"Pinned host storage is unavailable in the current PyTorch runtime ({error}); "
                "use ordinary CPU tensors (value.cpu())"
            ) from None
        return self._with_resident_tensors(pinned)
