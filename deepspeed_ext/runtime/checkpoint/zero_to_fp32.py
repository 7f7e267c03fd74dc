"""Consolidate a (ZeRO) checkpoint into one fp32 state dict, without a GPU.

    zero_to_fp32 <checkpoint_dir> <output_dir_or_file> [--tag T] [--safe_serialization]
                 [--max_shard_size 5GB] [--exclude_frozen_parameters]

[Note: streaming consolidation]
Partition files are opened memory-mapped, and parameters are assembled one bucket at a time
from every rank's chunk of it (see [Note: shard layout]); finished tensors go into the current
output shard, which is written and dropped once it reaches max_shard_size. Memory stays near
one output shard plus one bucket, however large the model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext import tp
from deepspeed_ext.zero.layout import GroupLayout

from . import atomic, layout
from .safe_load import CheckpointError
from .tensor_slices import saved_size, saved_tensor_size, stage_file_rank, whole_value


def _ckpt_dir(checkpoint_dir: str | Path, tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    if tag is None:
        tag = atomic.read_latest(root)
        if tag is None:
            if (root / layout.model_states_name()).exists():
                return root  # given the tag directory itself
            raise CheckpointError(f"no 'latest' file in {root}; pass --tag")
    d = root / str(tag)
    if not (d / layout.model_states_name()).exists():
        raise CheckpointError(f"{d} has no {layout.model_states_name()}: not a checkpoint")
    return d


def _load_mmap(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"missing partition file {path}") from None
    except (RuntimeError, OSError, EOFError) as e:  # truncated or corrupt
        raise CheckpointError(f"cannot read partition file {path}: {e}") from None


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // max(1, self.total)
            print(
                f"\r[zero_to_fp32] [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total} parameters",
                end="",
                file=sys.stderr,
                flush=True,
            )
            if self.done == self.total:
                print(file=sys.stderr)


class LazyTensor:
    """One consolidated value, read from the (memory-mapped) partition files only when
    `contiguous()` asks for it: `get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)`
    returns these, so a caller can walk a model larger than its memory one tensor at a time.
    `shape` and `dtype` (float32 for floating values) are known without reading."""

    def __init__(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        read: Callable[[], torch.Tensor],
        fresh: bool = False,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._read = read
        self._fresh = fresh  # read() makes a new fp32 tensor: no second copy is needed
        self._kept: torch.Tensor | None = None
        self.keep = False  # a tied value: read once, every name gets the same tensor

    def contiguous(self) -> torch.Tensor:
        if self._kept is not None:
            return self._kept
        t = self._read()
        if not (self._fresh and t.dtype == torch.float32):  # a view of a mapped file
            t = t.float().clone() if t.is_floating_point() else t.clone()
        t = t.reshape(self.shape)
        if self.keep:
            self._kept = t
        return t

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    """What a saved value consolidates to: fp32 if floating, else its own dtype."""
    return torch.float32 if t.is_floating_point() else t.dtype


def _lazy(t: torch.Tensor) -> LazyTensor:
    return LazyTensor(t.shape, _out_dtype(t), lambda: t)


def iter_fp32_params(
    checkpoint_dir: str | Path,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    progress: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) for every parameter and buffer, one tensor at a time."""
    for name, lazy in lazy_entries(checkpoint_dir, tag, exclude_frozen_parameters, progress):
        yield name, lazy.contiguous()


def lazy_entries(
    checkpoint_dir: str | Path,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    progress: bool | None = None,
) -> Iterator[tuple[str, LazyTensor]]:
    """(name, LazyTensor) for every parameter and buffer, in the module's order where the
    checkpoint records it; nothing is read until a value's `contiguous()`."""
    d = _ckpt_dir(checkpoint_dir, tag)
    states = _load_mmap(d / layout.model_states_name())
    if states.get("zero3_params"):
        yield from _iter_stage3(d, states, exclude_frozen_parameters, progress)
        return
    if states.get("pipeline"):
        yield from _iter_pipeline(d, exclude_frozen_parameters)
        return
    if saved_size(states) > 1:
        yield from _iter_tensor_parallel(d, states, exclude_frozen_parameters)
        return
    module: dict[str, torch.Tensor] = states["module"]
    layouts = [GroupLayout.from_dict(x) for x in (states.get("zero_layouts") or [])]
    slots = {s.name: (gi, s) for gi, g in enumerate(layouts) for s in g.slots}
    parts: list[Any] = []
    if layouts:
        world = layouts[0].world_size
        parts = [
            _load_mmap(d / layout.zero_optim_states_name(r))["fp32_partitions"]
            for r in range(world)
        ]
    bar = _Progress(len(slots), progress if progress is not None else len(slots) > 500)
    masters: dict[str, torch.Tensor] = states.get("master_weights") or {}  # stage 0, 16-bit
    frozen = set(states.get("frozen_param_names") or [])
    # module order, not the buckets' (gradient buckets run in reverse, backward's order)
    for name, t in module.items():
        if name in slots:
            gi, slot = slots.pop(name)
            yield name, _slot_value(parts, gi, layouts[gi], slot, bar)
        elif not (exclude_frozen_parameters and name in frozen):
            yield name, _lazy(masters.get(name, t))
    for name, (gi, slot) in slots.items():  # trained, not in the module's state dict
        yield name, _slot_value(parts, gi, layouts[gi], slot, bar)
    moe = states.get("moe") or {}
    if moe.get("expert_files"):  # [Note: expert checkpoint files]
        yield from _iter_expert_files(d, moe, frozen, exclude_frozen_parameters)


def _iter_expert_files(
    d: Path, moe: dict[str, Any], frozen: set[str], exclude_frozen: bool
) -> Iterator[tuple[str, LazyTensor]]:
    """Each expert of each MoE layer: its fp32 master, or its saved value (a buffer, a
    frozen param, an fp32 model's weight)."""
    for li, (_, num_experts) in enumerate(moe["layers"]):
        for g in range(num_experts):
            model_file, optim_file = layout.expert_file_names(li, g)
            held = _load_mmap(d / optim_file)
            masters, frozen_here = held["master_weights"], set(held.get("frozen", ()))
            for name, t in _load_mmap(d / model_file).items():
                if not (exclude_frozen and (name in frozen or name in frozen_here)):
                    yield name, _lazy(masters.get(name, t))


def _slot_value(parts: list[Any], gi: int, g: GroupLayout, s: Any, bar: _Progress) -> LazyTensor:
    """A ZeRO 1/2 parameter: its elements of the bucket, which rank r holds the r-th chunk
    of ([Note: shard layout]), taken from each rank's partition that overlaps them."""
    c = g.buckets[s.bucket].chunk(g.world_size)
    off = g.partition_offset(s.bucket)

    def read() -> torch.Tensor:
        bar.step()  # as it is read, not as it is listed
        if s.numel == 0:
            return torch.zeros(0)
        pieces = []
        lo, hi = s.offset, s.offset + s.numel
        for r in range(lo // c, (hi - 1) // c + 1):
            a, b = max(lo, r * c) - r * c, min(hi, (r + 1) * c) - r * c
            pieces.append(parts[r][gi][off + a : off + b])
        return torch.cat(pieces)

    return LazyTensor(torch.Size(s.shape), torch.float32, read, fresh=True)  # cat: a copy


def _iter_stage3(
    d: Path, states: Any, exclude_frozen: bool, progress: bool | None
) -> Iterator[tuple[str, LazyTensor]]:
    """Stage 3: each parameter is its ranks' shards concatenated ([Note: stage-3 checkpoint])."""
    from deepspeed_ext.zero.stage3.checkpoint import full_from_shards

    table = states["zero3_params"]
    world = int(states["dp_world_size"])
    parts = [_load_mmap(d / layout.zero_optim_states_name(r)) for r in range(world)]
    frozen = set(table["frozen"])
    bar = _Progress(len(table["params"]), progress if progress is not None else False)
    tied_targets = set(table["tied"].values())
    done: dict[str, LazyTensor] = {}  # only the tied ones

    def reader(key: str, name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            bar.step()  # as it is read, not as it is listed
            return full_from_shards([p[key][name] for p in parts], shape)

        return read

    for name, shape in table["params"]:
        if name in frozen and exclude_frozen:
            continue
        key = "param_shards" if name in frozen else "fp32_masters"
        lazy = LazyTensor(torch.Size(shape), torch.float32, reader(key, name, tuple(shape)))
        if name in tied_targets:
            lazy.keep = True
            done[name] = lazy
        yield name, lazy
    for alias, name in table["tied"].items():
        if name in done:
            yield alias, done[name]
    for name, t in states["module"].items():  # buffers
        yield name, _lazy(t)


def _iter_pipeline(d: Path, exclude_frozen: bool) -> Iterator[tuple[str, LazyTensor]]:
    """A pipeline checkpoint ([Note: pipeline checkpoint]): the layers' files give names and
    shapes; fp32 masters come from each stage's ZeRO files (or a 16-bit stage-0 model's
    master_weights; an fp32 stage-0 model's weights are its masters). Under tensor slicing
    each stage has a file set per tensor rank, its sliced parameters made whole from its
    slice table ([Note: AutoTP checkpoints])."""
    from deepspeed_ext.zero.named_state import from_zero

    from .engine_io import RankFileReader

    seen: set[str] = set()
    first = _load_mmap(d / layout.model_states_name(0))
    size = saved_tensor_size(first)
    for k in range(int(first["pipeline"]["num_stages"])):
        ranks = [stage_file_rank(k, t, size) for t in range(size)]
        states = [_load_mmap(d / layout.model_states_name(r)) for r in ranks]
        st = states[0]
        if int(st.get("zero_stage") or 0) > 0:
            masters = [from_zero(RankFileReader(d, r, _load_mmap)).masters for r in ranks]
        else:
            masters = [s.get("master_weights") or {} for s in states]
        table = dict((st.get("tensor_parallel") or {}).get("slices") or {})
        frozen = set(st.get("frozen_param_names") or [])
        for idx, prefix in sorted(
            st["pipeline"]["layer_prefixes"].items(), key=lambda x: int(x[0])
        ):
            files = _layer_files(d, int(idx), size)
            slices = [_load_mmap(f) for f in files]
            for key in slices[0]:
                name = prefix + key
                if name in seen or (exclude_frozen and name in frozen):
                    continue
                seen.add(name)
                values = []
                for m, sd in zip(masters, slices):
                    master = m.get(name)
                    values.append(sd[key] if master is None else master.reshape(sd[key].shape))
                yield name, _whole_lazy(name, values, table)


def _layer_files(d: Path, idx: int, size: int) -> list[Path]:
    """A layer's files, one per tensor rank in rank order (upstream's names: the rank's
    model coordinate, `-model_XX-`, only where the topology has that axis)."""
    files = sorted(d.glob(f"layer_{idx:02d}-*model_states.pt"))
    if size == 1:
        return files[:1]
    by_rank = [[f for f in files if f"-model_{t:02d}-" in f.name] for t in range(size)]
    missing = [t for t, fs in enumerate(by_rank) if not fs]
    if missing:
        raise FileNotFoundError(
            f"{d}: layer {idx}'s file for tensor-parallel rank(s) {missing} is missing"
        )
    return [fs[0] for fs in by_rank]


def _iter_tensor_parallel(
    d: Path, first: Any, exclude_frozen: bool
) -> Iterator[tuple[str, LazyTensor]]:
    """Tensor-sliced ([Note: AutoTP checkpoints]): each model-parallel rank's fp32 masters
    (its ZeRO files, or a 16-bit stage-0 model's master_weights, or the fp32 weights
    themselves), sliced parameters made whole from the saved slice table."""
    from deepspeed_ext.zero.named_state import from_zero

    from .engine_io import RankFileReader

    size = saved_size(first)
    states = [first] + [_load_mmap(d / layout.model_states_name(k)) for k in range(1, size)]
    if int(first.get("zero_stage") or 0) > 0:
        masters = [from_zero(RankFileReader(d, k, _load_mmap)).masters for k in range(size)]
    else:
        masters = [s.get("master_weights") or {} for s in states]
    table = dict(first["tensor_parallel"]["slices"])
    frozen = set(first.get("frozen_param_names") or [])
    tied = _tied_names(first["module"], masters[0])
    for name in first["module"]:
        if exclude_frozen and name in frozen:
            continue
        values = []
        for k, s in enumerate(states):
            saved = s["module"][name]
            master = masters[k].get(tied.get(name, name))
            values.append(saved if master is None else master.reshape(saved.shape))
        yield name, _whole_lazy(name, values, table)


def _whole_lazy(name: str, values: list[torch.Tensor], table: dict[str, Any]) -> LazyTensor:
    """A value saved by several tensor ranks, made whole (when sliced) only when read."""
    shape = tp.spec_from_table(table[name]).full_shape if name in table else values[0].shape

    def read() -> torch.Tensor:
        return whole_value(name, values, table)

    return LazyTensor(torch.Size(shape), _out_dtype(values[0]), read)


def _tied_names(module: dict[str, Any], masters: dict[str, Any]) -> dict[str, str]:
    """A tied parameter's other names (a tied lm_head) -> the name its master is kept
    under: torch.save keeps the tensors' shared storage, which tells them apart."""
    owner = {
        (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)): n
        for n, t in module.items()
        if n in masters and torch.is_tensor(t)
    }
    out = {}
    for n, t in module.items():
        if n in masters or not torch.is_tensor(t):
            continue
        other = owner.get((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)))
        if other is not None:
            out[n] = other
    return out


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | Path,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The consolidated fp32 state dict. With `lazy_mode` its values are LazyTensors, read
    from the memory-mapped files by `.contiguous()` one at a time (upstream's lazy mode)."""
    entries = lazy_entries(checkpoint_dir, tag, exclude_frozen_parameters)
    sd = dict(entries)
    return sd if lazy_mode else to_torch_tensor(sd)


_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _output_dtype(dtype: str | torch.dtype) -> torch.dtype:
    name = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else None
    out = _DTYPE_NAMES.get(name) if name is not None else dtype
    if out not in _DTYPE_NAMES.values():
        raise ValueError(
            f"output dtype {dtype!r} is not supported: use one of "
            + ", ".join(sorted(_DTYPE_NAMES))
        )
    return out  # type: ignore[return-value]


def to_torch_tensor(
    state_dict: dict[str, Any],
    return_empty_tensor: bool = False,
    dtype: str | torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """LazyTensors (or tensors) to tensors; names that shared one value share one tensor.
    `dtype` converts floating values only (integer and bool buffers keep theirs);
    `return_empty_tensor` gives uninitialized tensors of the right shape (for sizing)."""
    want = None if dtype is None else _output_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, v in state_dict.items():
        if id(v) in first:
            out[name] = out[first[id(v)]]
            continue
        first[id(v)] = name
        cast = want if want is not None and v.dtype.is_floating_point else v.dtype
        if return_empty_tensor:
            out[name] = torch.empty(v.shape, dtype=cast)
        else:
            out[name] = v.contiguous().to(cast)
    return out


def _parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", s.upper())
    if not m:
        raise ValueError(f"max_shard_size {s!r}: expected e.g. '5GB', '500MB' or a byte count")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index(m.group(2) or "B"))


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the consolidated fp32 weights (upstream's argument order); returns the files."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        torch.float32,
        max_shard_size,
        safe_serialization,
        tag,
        exclude_frozen_parameters,
    )


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    dtype: str | torch.dtype = torch.float32,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the consolidated weights, floating ones as `dtype` (float32, float16 or
    bfloat16); returns the files written. `output_dir` is a directory (pytorch_model.bin or
    model.safetensors, sharded with an index json as Hugging Face does when larger than
    max_shard_size; None: never sharded) or a .bin/.pt/.safetensors file."""
    want = _output_dtype(dtype)
    output = output_dir
    out = Path(output)
    if out.suffix in (".bin", ".pt", ".pth", ".safetensors"):
        safe_serialization = safe_serialization or out.suffix == ".safetensors"
        out_dir, base = out.parent, out.name
    else:
        out_dir, base = out, "model.safetensors" if safe_serialization else "pytorch_model.bin"
    out_dir.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError(
                "safe_serialization needs the safetensors package: pip install safetensors"
            ) from None
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    current: dict[str, torch.Tensor] = {}
    size = 0

    stem, ext = re.match(r"(.*?)(\.[a-z]+)$", base).groups()  # type: ignore[union-attr]

    def flush() -> None:
        nonlocal current, size
        if not current:
            return
        idx = len(files) + 1
        # named when the count is known (below): Hugging Face loads a file named `base`
        # alone, before any index, so no shard may carry that name meanwhile
        name = f"{stem}-{idx:05d}.partial{ext}"
        path = out_dir / name
        if safe_serialization:
            save_file(
                {k: v.contiguous() for k, v in current.items()},
                str(path),
                metadata={"format": "pt"},
            )
        else:
            torch.save(current, path)
        files.append(path)
        for k in current:
            weight_map[k] = name
        current, size = {}, 0

    for name, t in iter_fp32_params(checkpoint_dir, tag, exclude_frozen_parameters):
        if t.is_floating_point():
            t = t.to(want)
        nbytes = t.numel() * t.element_size()
        if current and limit is not None and size + nbytes > limit:
            flush()
        current[name] = t
        size += nbytes
    flush()
    return _name_shards(files, weight_map, out_dir, base, stem, ext)


def _name_shards(
    files: list[Path], weight_map: dict[str, str], out_dir: Path, base: str, stem: str, ext: str
) -> list[Path]:
    """One file: `base`. Several: Hugging Face's <stem>-0000i-of-0000n<ext> with
    <base>.index.json, and no file named `base` left beside them (from_pretrained would load
    it alone)."""
    n = len(files)
    names = [base] if n == 1 else [f"{stem}-{i:05d}-of-{n:05d}{ext}" for i in range(1, n + 1)]
    out = []
    for f, name in zip(files, names):
        out.append(f.replace(out_dir / name))
    if n > 1:
        (out_dir / base).unlink(missing_ok=True)  # an earlier unsharded export
        rename = {f.name: name for f, name in zip(files, names)}
        total = sum(p.stat().st_size for p in out)
        weight_map = {k: rename[v] for k, v in weight_map.items()}
        index = out_dir / (base + ".index.json")
        meta = {"metadata": {"total_size": total}, "weight_map": weight_map}
        index.write_text(json.dumps(meta, indent=2))
        out.append(index)
    return out


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | Path, tag: str | None = None
) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (moved to CPU) and return it."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(sd, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zero_to_fp32",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("checkpoint_dir", help="the save_dir given to save_checkpoint (holds 'latest')")
    ap.add_argument("output", help="output directory, or a .bin/.pt/.safetensors file")
    ap.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: 'latest')")
    ap.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    ap.add_argument("--max_shard_size", default="5GB")
    ap.add_argument("--exclude_frozen_parameters", action="store_true")
    ap.add_argument(
        "--dtype", default="float32", help="floating values as float32 (default), fp16 or bf16"
    )
    # upstream's flag for its debug prints; this tool prints each file it writes anyway
    ap.add_argument("-d", "--debug", action="store_true", help="accepted for upstream's CLI")
    args = ap.parse_args(argv)
    try:
        files = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir,
            args.output,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (CheckpointError, ValueError, ImportError) as exc:
        print(f"zero_to_fp32: {exc}", file=sys.stderr)
        return 1
    for f in files:
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
