"""Per-rank model-state memory, measured from the live tensors, within 10% of the ZeRO paper's
formulas as the memory estimator computes them ([Note: model-state memory] in
deepspeed_ext/zero/estimate.py): Psi params, K = 12 (fp32 master, m, v), N ranks, 16-bit
model and gradients (bf16 model, grad_accum_dtype bf16):
  stage 0: (2 + 2 + K) Psi    stage 1: 2Psi + 2Psi + K Psi / N    stage 2: 2Psi + (2 + K) Psi / N
  stage 3: (2 + 2 + K) Psi / N (measured after a step, when every parameter is released; its
  gradient partitions are measured before the step: the step's zeroing frees them)
and for an fp32 model with fp32 gradients K = 8: its own chunks are the masters.
"""

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks


def _bytes(tensors, seen=None) -> int:
    """Bytes of the distinct storages behind the tensors (views counted once; storages in
    `seen` already counted elsewhere)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _measure(stage: int, dtype: str = "bf16") -> dict:
    import os

    from deepspeed_ext.runtime.initialize import initialize

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])  # ~395K params
    psi = sum(p.numel() for p in model.parameters())
    engine, opt, _, _ = initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": dtype == "bf16"},
            "data_types": {"grad_accum_dtype": dtype},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 50_000,
                "stage3_param_persistence_threshold": 0,
            },
        },
    )
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 256, generator=g).to(
        getattr(torch, {"bf16": "bfloat16"}.get(dtype, "float32"))
    )
    engine.backward(engine(x).float().pow(2).mean())
    s = engine.strategy
    held = list(s.reducer.grads()) if stage == 3 else []
    engine.step()
    if stage == 3:  # the model's .data is empty: shards, grad partitions, fp32 masters
        params = [t for p in engine.module.parameters() for t in (p.data, p.ds_tensor)]
        grads = held
        masters = list(s.masters.values())
    elif stage == 0:
        params = list(engine.module.parameters())
        grads = s.grads.flat()
        masters = s.masters.masters
    else:
        params = [grp.flat for grp in s.groups]
        grads = [*s.reducer.buffers.values(), *[t for grp in s.groups for t in grp.grads]]
        masters = [m for grp in s.groups for m in grp.masters]
    states = [
        t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.numel() > 1
    ]
    seen: set = set()
    return {
        "psi": psi,
        "params": _bytes(params, seen),
        "grads": _bytes(grads, seen),
        "optim": _bytes(masters, seen) + _bytes(states, seen),  # masters that are not params
    }


@pytest.mark.parametrize(
    "stage,world,dtype",
    [(1, 2, "bf16"), (2, 2, "bf16"), (3, 2, "bf16"), (1, 4, "bf16"), (2, 4, "bf16")]
    + [(3, 4, "bf16"), (0, 2, "fp32"), (2, 2, "fp32")],
)
def test_model_state_bytes_follow_the_estimator(stage, world, dtype):
    from deepspeed_ext.zero.estimate import zero_model_state_memory

    size = 2 if dtype == "bf16" else 4
    for r in run_ranks(_measure, world, stage, dtype):
        est = zero_model_state_memory(r["psi"], world, stage, param_bytes=size, grad_bytes=size)
        want = {"params": est.params, "grads": est.grads, "optim": est.optimizer}
        for part, expected in want.items():
            assert abs(r[part] - expected) <= 0.10 * expected, (part, r[part], expected)
        total = sum(r[p] for p in want)
        assert abs(total - sum(want.values())) <= 0.10 * sum(want.values())


def _saved_bytes_after_forward() -> dict:
    """Bytes of the storages autograd saved in a stage-3 forward whose parameters are all
    released again (reuse distance 0): activations only, since `weight.t()` views of a
    released parameter keep a storage resized to 0 ([Note: stage-3 parameter])."""
    from deepspeed_ext.runtime.initialize import initialize

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)])  # 4 MB
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        },
    }
    engine, *_ = initialize(model=model, config=cfg)
    out = engine(torch.randn(4, 512))
    seen, saved, stack = set(), 0, [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for name in dir(fn):
            v = getattr(fn, name) if name.startswith("_saved_") else None
            if torch.is_tensor(v):
                saved += v.untyped_storage().nbytes()
        stack.extend(n for n, _ in fn.next_functions)
    engine.backward(out.pow(2).mean())
    engine.step()
    return {"saved": saved, "activations": 4 * 4 * 512 * 4}


def test_released_parameters_free_their_memory_between_forward_and_backward():
    for r in run_ranks(_saved_bytes_after_forward, 2):
        assert r["saved"] <= r["activations"], r
