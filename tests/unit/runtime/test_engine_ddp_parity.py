"""Engine (stage 0) on 2 gloo ranks vs torch DDP, same optimizer, fp32: equal parameters
after N steps, with gradient accumulation and clipping."""

import torch

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import batch, loss_fn, mlp

STEPS, GAS, CLIP, LR = 6, 2, 0.05, 1e-2


def _engine_rank(opt: str = "adamw") -> list[torch.Tensor]:
    import deepspeed_ext.comm as comm
    from deepspeed_ext.runtime.initialize import initialize

    rank = int(__import__("os").environ["RANK"])
    engine, *_ = initialize(
        model=mlp(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP if opt == "adamw" else 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
            if opt == "adamw"
            else {"type": "SGD", "params": {"lr": 0.1}},
            "steps_per_print": 1000,
        },
    )
    norms = []
    for micro in range(STEPS * GAS):
        x, y = batch(micro, rank)
        loss = loss_fn(engine, x, y)
        engine.backward(loss)
        engine.step()
        if engine.get_global_grad_norm() is not None:
            norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == STEPS
    if opt == "adamw":
        assert max(norms) > 2 * CLIP, f"clipping never engaged (norms {norms}): a blind test"
    out = [p.detach().clone() for p in engine.module.parameters()]
    comm.destroy_process_group()
    return out


def _ddp_rank(opt: str = "adamw") -> list[torch.Tensor]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(mlp())
    sgd = opt == "sgd"
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if sgd
        else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    )
    for micro in range(STEPS * GAS):
        x, y = batch(micro, rank)
        boundary = (micro + 1) % GAS == 0
        ctx = model.no_sync() if not boundary else torch.enable_grad()
        with ctx:
            (loss_fn(model, x, y) / GAS).backward()
        if boundary:
            if not sgd:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    out = [p.detach().clone() for p in model.module.parameters()]
    dist.destroy_process_group()
    return out


def test_two_ranks_match_ddp_with_sgd_without_clipping():
    """Adam and clipping hide a wrong gradient scale; plain SGD does not."""
    ours = run_ranks(_engine_rank, 2, "sgd")
    ref = run_ranks(_ddp_rank, 2, "sgd")
    for a, b in zip(ours[0], ref[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_two_ranks_match_ddp_with_accumulation_and_clipping():
    ours = run_ranks(_engine_rank, 2)
    ref = run_ranks(_ddp_rank, 2)
    for a, b in zip(ours[0], ours[1]):
        assert torch.equal(a, b), "ranks diverged"
    for a, b in zip(ours[0], ref[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    # and training moved the weights at all (a no-op engine would match nothing above, but
    # make the failure obvious)
    assert any(not torch.equal(a, b) for a, b in zip(ours[0], mlp().parameters()))
