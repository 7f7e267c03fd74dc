"""The accelerator interface the runtime programs against (upstream's method names)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Accelerator(abc.ABC):
    _name: str = ""
    _communication_backend_name: str = ""

    # -- identity ----------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def product_name(self, device_index: int | None = None) -> str:
        """The hardware's own name (e.g. "NVIDIA H100 80GB HBM3"), for reports."""
        return self._name

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    @abc.abstractmethod
    def is_available(self) -> bool: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None: ...

    def is_synchronized_device(self) -> bool:
        """True when kernels complete before the call returns (no streams to wait on)."""
        return False

    # -- dtypes --------------------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    # -- memory ------------------------------------------------------------------------------
    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int: ...

    def available_memory(self, device_index: int | None = None) -> int:
        return self.total_memory(device_index) - self.memory_allocated(device_index)

    def empty_cache(self) -> None:
        return None

    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor: ...

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if tensor.device.type == "cpu" else False

    # -- execution -----------------------------------------------------------------------------
    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def Stream(self, *args: Any, **kwargs: Any) -> Any: ...  # noqa: N802 - upstream's name

    @abc.abstractmethod
    def Event(self, **kwargs: Any) -> Any: ...  # noqa: N802 - upstream's name

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...

    def default_stream(self, device_index: int | None = None) -> Any:
        return self.current_stream(device_index)

    # -- RNG -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor: ...

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None: ...

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # -- profiling ranges (no-ops unless the backend has them) -------------------------------
    def range_push(self, msg: str) -> None:
        return None

    def range_pop(self) -> None:
        return None

    @contextlib.contextmanager
    def range(self, msg: str) -> Iterator[None]:
        self.range_push(msg)
        try:
            yield
        finally:
            self.range_pop()

    # -- ops -------------------------------------------------------------------------------------
    def op_builder_dir(self) -> str:
        return "deepspeed_ext.op_builder"

    def get_op_builder(self, class_name: str) -> type | None:
        from deepspeed_ext import op_builder

        return getattr(op_builder, class_name, None) or _builder_by_class(class_name)

    def create_op_builder(self, class_name: str) -> Any:
        cls = self.get_op_builder(class_name)
        return cls() if cls is not None else None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name} ({self._communication_backend_name})>"


def _builder_by_class(class_name: str) -> type | None:
    from deepspeed_ext.op_builder import ALL_OPS

    for cls in ALL_OPS.values():
        if cls.__name__ == class_name:
            return cls
    return None
