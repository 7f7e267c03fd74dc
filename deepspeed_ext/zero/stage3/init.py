"""deepspeed.zero.Init: build a model already partitioned.

[Note: zero.Init]
Inside the context every nn.Module subclass's __init__ is wrapped: when an object's outermost
__init__ returns (its constructor has created and initialized its own parameters), the
parameters not yet partitioned are broadcast from rank 0 (so every rank starts equal) and
partitioned. A model therefore never exists whole: at most one module's own parameters are
full at a time. Classes defined inside the context are wrapped as they are created
(__init_subclass__). On exit every wrapper is removed or, for classes created inside, made
inert. Parameters a parent creates or re-ties after its children are built (tied weights)
are the same Parameter objects, already partitioned, or new ones partitioned with the parent.
`module.apply(fn)` (how models re-initialize weights after construction) runs fn on each
module with its own parameters gathered, rank 0's result broadcast and re-partitioned;
other changes after construction need GatheredParameters(..., modifier_rank=0).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.accelerator import get_accelerator
from deepspeed_ext.comm import group_broadcast, init_distributed, is_initialized
from deepspeed_ext.comm.layout import data_axis
from deepspeed_ext.config import DeepSpeedConfig, parse

from ..keep_fp32 import keep_fp32
from .kept_whole import kept_whole
from .param import convert, is_zero_param

_DEFAULT_PERSISTENCE = 100_000
# Inside an Init with a dtype (from the config's fp16 / bf16, or given), these constructors
# make floating tensors in that dtype, as upstream's Init makes them ([Note: module cast]):
# a buffer made by torch.ones(d) is 16-bit, one made by arange(...).float() stays fp32.
# transformers' prevent_arange_dtype_change swaps the wrapper for _orig_torch_arange.
_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")
_ORIGINAL = {name: getattr(torch, name) for name in _CONSTRUCTORS}
_orig_torch_arange = torch.arange


@contextlib.contextmanager
def torch_constructors() -> Iterator[None]:
    """torch's own constructors for a while, inside an Init that changed them: this
    package's internals ask for the dtypes they mean (fp32 masters, float64 sums), and
    deepspeed.initialize runs inside it ([Note: module cast])."""
    now = {name: getattr(torch, name) for name in _CONSTRUCTORS}
    for name, fn in _ORIGINAL.items():
        setattr(torch, name, fn)
    try:
        yield
    finally:
        for name, fn in now.items():
            setattr(torch, name, fn)


def zero_wrapper_for_fp_tensor_constructor(
    fn: Any, target_fp_dtype: torch.dtype | None = None, target_device: Any = None
) -> Any:
    """fn with floating results cast to target_fp_dtype, placed on target_device."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        out = fn(*args, **kwargs)
        if target_fp_dtype is not None and out.is_floating_point():
            out.data = out.data.to(target_fp_dtype)  # .data: a requires_grad one stays a leaf
        return out

    return wrapped


_active: list[Init] = []
_building = [0]  # modules whose __init__ is running (0: the last one built was outermost)


def _all_subclasses(cls: type) -> list[type]:
    out: list[type] = []
    stack: list[type] = [cls]
    while stack:
        subs: list[type] = stack.pop().__subclasses__()
        for sub in subs:
            out.append(sub)
            stack.append(sub)
    return out


def _read_config(config: Any) -> DeepSpeedConfig | None:
    """The typed config (so its keys are checked here too), or None without one."""
    if config is None:
        return None
    if not isinstance(config, (dict, str, Path, DeepSpeedConfig)):
        to_dict = getattr(config, "to_dict", None)  # another library's config object
        config = dict(to_dict()) if callable(to_dict) else None
    return parse(config) if config is not None else None


# upstream's other Init arguments: all belong to features not built yet; their defaults are
# what this Init does
_UNBUILT_ARGS = {
    "zero_param_parallel_group": (None, "hierarchical partitions (ZeRO++ hpZ)"),
    "zero_quantized_weights": (False, "quantized weights (ZeRO++)"),
    "zero_quantized_nontrainable_weights": (False, "quantized weights (ZeRO++)"),
    "sequence_data_parallel_group": (None, "sequence parallelism"),
    "param_swapper": (None, "a custom parameter swapper"),
}


def _refuse_unbuilt(kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if name not in _UNBUILT_ARGS:
            raise TypeError(f"zero.Init() got an unexpected keyword argument {name!r}")
        default, what = _UNBUILT_ARGS[name]
        if value is not default and value != default:
            raise ValueError(f"zero.Init({name}=...): {what} is not built yet; leave it out")


class Init:
    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **upstream_only: Any,
    ) -> None:
        _refuse_unbuilt(upstream_only)
        self.enabled = enabled
        if not enabled:
            return
        cfg = _read_config(config_dict_or_path if config_dict_or_path is not None else config)
        zero = cfg.zero_optimization if cfg is not None else None
        self.persistence = (
            int(zero.stage3_param_persistence_threshold) if zero else _DEFAULT_PERSISTENCE
        )
        offload = zero.offload_param.device if zero and zero.offload_param else "none"
        self.override_apply = bool(zero.override_module_apply) if zero else True
        self.allowed_types = zero.zero_allowed_param_types if zero else None
        self.forced_types = zero.zero_force_param_types if zero else ()
        remote = remote_device if remote_device is not None else offload
        self.shard_device = (
            torch.device("cpu") if str(remote).lower() in ("cpu", "nvme") else self._device()
        )
        self.pin_memory = pin_memory
        self.dtype = dtype or (self._config_dtype(cfg) if cfg is not None else None)
        self.keep = cfg.data_types.keep_in_fp32_modules if cfg is not None else "auto"
        if not is_initialized():
            init_distributed(verbose=False)
        # partitioned over the data-parallel group: an explicit one, the mpu's, or the
        # current layout's (the whole world without model parallelism)
        self.group = data_axis(data_parallel_group, mpu)
        self._patched: list[tuple[Any, Any]] = []  # (class or module, (attribute, original))
        if module is not None:
            self.partition_module(module)
            self.keep_buffers(module)

    @staticmethod
    def _device() -> torch.device:
        acc = get_accelerator()
        return acc.device(acc.current_device())  # the CPU accelerator: plain "cpu"

    @staticmethod
    def _config_dtype(cfg: DeepSpeedConfig) -> torch.dtype | None:
        if cfg.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if cfg.bf16.enabled else None

    # -- partitioning --
    @torch.no_grad()
    def partition_module(self, module: torch.nn.Module) -> None:
        p: Any
        whole = kept_whole(module, self.allowed_types, self.forced_types)
        for name, p in module.named_parameters():
            if is_zero_param(p):
                continue
            if p.is_meta:  # skip_init, device="meta": no values yet; the engine partitions
                continue  # it at initialize, once it has them (every rank skips alike)
            p.ds_name = f"{type(module).__name__}.{name}"  # the engine renames it by model path
            full = p.data.to(self._device(), dtype=self.dtype or p.dtype)
            group_broadcast(full, self.group)  # every replica starts from its group's rank 0
            p.data = full
            persist = p.numel() <= self.persistence or id(p) in whole
            convert(p, self.group, self.shard_device, full.device, persist)
            if self.pin_memory and self.shard_device.type == "cpu" and full.device.type != "cpu":
                p.ds_tensor = p.ds_tensor.pin_memory()

    def keep_buffers(self, module: torch.nn.Module) -> None:
        """The buffers the model names for fp32 (data_types.keep_in_fp32_modules), back to
        fp32 once a whole module is built in this Init's dtype."""
        if self.dtype is not None:
            keep_fp32(module, self.keep, self.dtype)

    # -- the context --
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        _active.append(self)
        for cls in [torch.nn.Module, *_all_subclasses(torch.nn.Module)]:
            self._wrap(cls)
        original = torch.nn.Module.__dict__.get("__init_subclass__")
        self._patched.append((torch.nn.Module, ("__init_subclass__", original)))

        def init_subclass(cls: Any, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            if _active:  # the outermost Init undoes it: an inner one's exit is not the end
                _active[0]._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        if self.dtype is not None:
            for name in _CONSTRUCTORS:  # torch's own, wrapped (an inner Init's dtype wins)
                self._patched.append((torch, (name, getattr(torch, name))))
                wrapped = zero_wrapper_for_fp_tensor_constructor(_ORIGINAL[name], self.dtype)
                setattr(torch, name, wrapped)
        if self.override_apply:  # zero_optimization.override_module_apply
            original_apply = torch.nn.Module.__dict__["apply"]
            self._patched.append((torch.nn.Module, ("apply", original_apply)))
            torch.nn.Module.apply = _gathering_apply(original_apply)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        for cls, (attr, original) in reversed(self._patched):
            if original is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, original)
        self._patched.clear()
        _active.remove(self)

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_z3_wrapped", False):
            return

        @functools.wraps(original)
        def init(obj: Any, *args: Any, **kwargs: Any) -> None:
            depth = obj.__dict__.get("_z3_init_depth", 0)
            object.__setattr__(obj, "_z3_init_depth", depth + 1)
            _building[0] += 1
            try:
                original(obj, *args, **kwargs)
            finally:
                object.__setattr__(obj, "_z3_init_depth", depth)
                _building[0] -= 1
            if depth == 0 and _active:
                _active[-1].partition_module(obj)
                if _building[0] == 0:  # the outermost module built: full names ([Note:
                    _active[-1].keep_buffers(obj)  # module cast]), before a checkpoint loads

        init._z3_wrapped = True  # type: ignore[attr-defined]
        cls.__init__ = init  # type: ignore[misc]
        self._patched.append((cls, ("__init__", original)))


def _gathering_apply(original: Any) -> Any:
    @functools.wraps(original)
    def apply(self: torch.nn.Module, fn: Any) -> torch.nn.Module:
        from .gathered import GatheredParameters

        def gathered_fn(m: torch.nn.Module) -> None:
            own = [p for p in m.parameters(recurse=False) if is_zero_param(p)]
            with GatheredParameters(own, modifier_rank=0, enabled=bool(own)):
                fn(m)

        return original(self, gathered_fn)

    return apply
