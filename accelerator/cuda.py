"""CUDA accelerator: NCCL, CUDA memory stats, real streams and events."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .abstract import Accelerator


class CUDAAccelerator(Accelerator):
    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def product_name(self, device_index: int | None = None) -> str:
        return str(torch.cuda.get_device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def compute_capability(self, device_index: int | None = None) -> tuple[int, int]:
        """(major, minor); from the device's properties, which torch.compile folds to a
        constant (get_device_capability would break the graph)."""
        props = torch.cuda.get_device_properties(device_index or 0)
        return props.major, props.minor

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return torch.cuda.Stream(*args, **kwargs)

    def Event(self, **kwargs: Any) -> Any:  # noqa: N802
        return torch.cuda.Event(**kwargs)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()
