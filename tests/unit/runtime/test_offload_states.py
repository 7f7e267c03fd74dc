"""engine.offload_states() / reload_states() ([Note: offloading states]) on 2 spawned ranks
in device-strict mode, at ZeRO stages 0-3, fp32 and bf16: every kind's old storages are freed
(their memory released, checked by weak reference) and the tensors now declared host; training
while offloaded is refused; after reload_states() training goes on exactly as a run that never
offloaded (same losses, bit for bit); include= moves only the kinds named; bad arguments are
refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

CASES = [(0, False), (0, True), (1, True), (2, False), (3, True)]


def _engine(stage: int, bf16: bool, extra: dict[str, Any] | None = None) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **(extra or {})},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def _train(engine: Any, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed + engine.global_rank)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    losses = []
    for _ in range(steps * 2):  # two micro-steps a step
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        loss = ((engine(x.to(dtype)).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _weak(tensors: list[torch.Tensor]) -> list[int]:
    return [t.untyped_storage()._weak_ref() for t in tensors if t.untyped_storage().nbytes()]


def _gone(refs: list[int]) -> bool:
    import gc

    gc.collect()
    return all(torch.UntypedStorage._expired(w) for w in refs)


def _state_tensors(engine: Any) -> list[torch.Tensor]:
    from deepspeed_ext.runtime.offload_states import optimizer_state_tensors

    return optimizer_state_tensors(engine.optimizer)


def _roots(engine: Any, kind: str) -> list[torch.Tensor]:
    return [t for t in engine.strategy.state_roots(kind) if t is not None]


def _scenario() -> dict[str, Any]:
    from deepspeed_ext.accelerator import strict
    from deepspeed_ext.runtime.offload_states import OffloadStateTypeEnum

    out: dict[str, Any] = {}
    for stage, bf16 in CASES:
        plain = _engine(stage, bf16)
        want = _train(plain, 2, seed=1) + _train(plain, 2, seed=2)
        plain.destroy()

        engine = _engine(stage, bf16)
        got = _train(engine, 2, seed=1)
        kinds = ["lp_params", "hp_params", "lp_grads", "contiguous_grad_buffer"]
        roots = {k: _roots(engine, k) for k in kinds}
        refs = {k: _weak(v) for k, v in roots.items()}
        refs["optim_states"] = _weak(_state_tensors(engine))
        counts = {k: len(v) for k, v in refs.items()}
        del roots
        engine.offload_states()
        freed = {k: _gone(v) for k, v in refs.items()}
        host = all(strict.is_host(t) for t in _state_tensors(engine))
        host = host and all(strict.is_host(t) for t in _roots(engine, "lp_params"))
        try:
            _train(engine, 1, seed=3)
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        engine.reload_states()
        device_again = not any(strict.is_host(t) for t in _roots(engine, "lp_params"))
        got += _train(engine, 2, seed=2)
        out[f"stage {stage} bf16 {bf16}"] = {
            "same losses": got == want,
            "freed": freed,
            "counts": counts,
            "host": host,
            "refused": refused,
            "device again": device_again,
        }
        engine.destroy()

    # include: only the optimizer states move
    engine = _engine(2, True)
    _train(engine, 1, seed=1)
    params, states = _weak(_roots(engine, "lp_params")), _weak(_state_tensors(engine))
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    out["include"] = (_gone(params), _gone(states))
    engine.reload_states()
    errors = []
    for call in (
        lambda: engine.offload_states(device="nvme"),
        lambda: engine.offload_states(include=["moments"]),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    engine.destroy()
    param_off = _engine(3, False, {"offload_param": {"device": "cpu"}})
    try:
        param_off.offload_states()
    except RuntimeError as e:
        errors.append(str(e))
    out["errors"] = errors
    # rank 0 holds the store: leaving first, it would break a peer still creating the last
    # engine's groups (its refused offload returns at once)
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def res() -> dict[str, Any]:
    return run_ranks(_scenario, 2)[0]


@pytest.mark.parametrize("stage, bf16", CASES)
def test_offload_frees_every_kind_and_training_resumes_exactly(res, stage, bf16):
    r = res[f"stage {stage} bf16 {bf16}"]
    assert r["same losses"], "training after reload_states differs from a run never offloaded"
    assert r["host"] and r["device again"]
    for kind, freed in r["freed"].items():
        assert freed, f"{kind}: the device storages are still alive after offload_states"
    assert r["counts"]["lp_params"] and r["counts"]["optim_states"]
    if bf16:  # a 16-bit model's fp32 masters are a copy of their own
        assert r["counts"]["hp_params"]
    assert "call engine.reload_states() first" in r["refused"]


def test_include_moves_only_the_kinds_named(res):
    params_freed, states_freed = res["include"]
    assert states_freed and not params_freed


def test_bad_arguments_are_refused_by_name(res):
    nvme, kind, param_offload = res["errors"]
    assert "device='nvme'" in nvme and "'cpu' only" in nvme
    assert "'moments'" in kind and "optim_states" in kind
    assert "zero_optimization.offload_param" in param_offload


def test_a_storage_held_from_cpp_undoes_the_move():
    """A view Python cannot see (here autograd keeps exp's result for its backward) would
    keep the old storage alive: the move is undone and the error says why."""
    from deepspeed_ext.runtime.offload_states import move

    a = torch.randn(6, requires_grad=True)
    b = a.exp()
    grad_fn = b.grad_fn  # holds b's storage in C++
    root = b.detach()
    before, ptr = root.clone(), root.data_ptr()
    del b
    with pytest.raises(RuntimeError, match="stay referenced by tensors Python cannot see"):
        move([root], torch.device("cpu"), True, False, False, nn.Linear(1, 1), [])
    assert root.data_ptr() == ptr and torch.equal(root, before)  # back on its own storage
    assert grad_fn is not None


def test_tensors_without_data_are_passed_over():
    """The scan meets tensors whose storage has no data pointer (the fake and functional
    tensors a torch.compile leaves behind): it passes them over instead of failing."""
    from deepspeed_ext.runtime.offload_states import move

    lin = nn.Linear(3, 3)
    compiled = torch.compile(lin, backend="aot_eager")
    compiled(torch.randn(2, 3, requires_grad=True)).sum().backward()
    root = torch.randn(5)
    before = root.clone()
    assert len(move([root], torch.device("cpu"), True, False, False, nn.Linear(1, 1), [])) == 1
    assert torch.equal(root, before)
