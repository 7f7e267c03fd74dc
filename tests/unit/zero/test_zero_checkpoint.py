"""ZeRO checkpoints: exact resume at the same world size, zero_to_fp32 equal to the live
weights, and a clear refusal at another world size."""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.subproc import env_with

CFG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": 1000,
}


def _steps(engine, first: int, n: int) -> list[float]:
    import os

    from tests.unit.runtime.models import batch, loss_fn

    rank = int(os.environ["RANK"])
    out = []
    for s in range(first, first + n):
        for m in range(2):
            x, y = batch(10 * s + m, rank, size=4)
            loss = loss_fn(engine, x, y)
            engine.backward(loss)
            engine.step()
            out.append(float(loss))
    return out


def _resume(stage: int, save_dir: str, nvme: str | None = None) -> dict:
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.zero.zero_runs import Net

    zero = {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}
    if nvme:  # shards, masters and moments in swap files
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    cfg = {**CFG, "zero_optimization": zero}
    full, *_ = initialize(model=Net(), config=cfg)
    want = _steps(full, 0, 6)[6:]
    a, *_ = initialize(model=Net(), config=cfg)
    _steps(a, 0, 3)
    a.save_checkpoint(save_dir)
    live = full_state(a.module)
    torch.manual_seed(99)
    b, *_ = initialize(model=Net(), config=cfg)
    b.load_checkpoint(save_dir)
    got = _steps(b, 3, 3)
    return {"want": want, "got": got, "live": live}


def full_state(module) -> dict:
    from deepspeed_ext.zero.stage3 import GatheredParameters

    with GatheredParameters(list(module.parameters())):  # a no-op below stage 3
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3, "3-nvme"])
def test_resume_is_exact_and_zero_to_fp32_equals_live_weights(stage, tmp_path):
    nvme = str(tmp_path / "nvme") if stage == "3-nvme" else None
    results = run_ranks(_resume, 2, 3 if nvme else stage, str(tmp_path / "ckpt"), nvme)
    tmp_path = tmp_path / "ckpt"
    for r in results:
        assert r["got"] == r["want"], "resumed run differs from the uninterrupted one"
    names = sorted((tmp_path / "global_step3").iterdir())
    assert [n.name for n in names] == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )

    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    live = results[0]["live"]
    assert set(live) <= set(sd)
    for n, p in live.items():
        assert torch.equal(sd[n], p), n
    # the module's order (it came in the gradient buckets' order, backward's: reversed)
    assert [k for k in sd if k in live] == list(live)
    _upstream_api_forms(tmp_path, live)

    # the CLI, to sharded safetensors
    out = tmp_path / "fp32"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.utils.zero_to_fp32",
            str(tmp_path),
            str(out),
            "--safe_serialization",
            "--max_shard_size",
            "2KB",
        ],
        env=env_with(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    shards = sorted(out.glob("model*.safetensors"))
    n = len(shards)
    # Hugging Face's names: a file named model.safetensors would be loaded alone, before the
    # index, and the other shards' weights left random
    assert n > 1 and [f.name for f in shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    merged = {k: v for f in shards for k, v in load_file(str(f)).items()}
    assert {k: f for k, f in index["weight_map"].items()} == {
        k: f.name for f in shards for k in load_file(str(f))
    }
    for n, p in live.items():
        assert torch.equal(merged[n], p), n

    # upstream's -d is taken; a truncated partition file is named (it was torch's traceback)
    import shutil

    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import main

    broken = tmp_path.parent / f"{tmp_path.name}-broken"
    shutil.copytree(tmp_path, broken, ignore=shutil.ignore_patterns("fp32"))
    part = next(broken.glob("*/zero_pp_rank_1_*optim_states.pt"))
    part.write_bytes(part.read_bytes()[:500])
    assert main([str(broken), str(broken / "out"), "-d"]) == 1
    assert main([str(tmp_path), str(tmp_path / "out-d"), "-d"]) == 0


def _upstream_api_forms(ckpt, live: dict) -> None:
    """Upstream's lazy mode, positional argument order and 16-bit variant."""
    from deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        convert_zero_checkpoint_to_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        to_torch_tensor,
    )

    lazy = get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    assert list(lazy) == list(get_fp32_state_dict_from_zero_checkpoint(ckpt))
    for n, p in live.items():
        assert not torch.is_tensor(lazy[n]) and lazy[n].shape == p.shape, n
        assert lazy[n].dtype == torch.float32 and torch.equal(lazy[n].contiguous(), p), n
    half = to_torch_tensor(lazy, dtype="bf16")
    assert all(half[n].dtype == torch.bfloat16 for n in live)

    # (dir, output_dir, max_shard_size, safe_serialization, ...): a shard limit given where
    # the old order had the tag was taken as a tag
    out = ckpt.parent / f"{ckpt.name}-positional"
    files = convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, "2KB", True)
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1, files
    out = ckpt.parent / f"{ckpt.name}-fp16"
    convert_zero_checkpoint_to_state_dict(ckpt, out, dtype="fp16", max_shard_size=None)
    sd16 = torch.load(out / "pytorch_model.bin", weights_only=True)
    for n, p in live.items():
        assert sd16[n].dtype == torch.float16 and torch.equal(sd16[n], p.half()), n
    with pytest.raises(ValueError, match="'int8' is not supported: use one of"):
        convert_zero_checkpoint_to_state_dict(ckpt, out, dtype="int8")


def _global_steps(engine, first: int, n: int) -> None:
    """The same global batch of 8 per step at any world size: 2 ranks take 4 each, 1 rank
    all 8, 4 ranks 2 each. Equal-size means make the averaged gradient identical."""
    import os

    from torch import nn

    from tests.unit.runtime.models import batch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for s in range(first, first + n):
        xs, ys = zip(*(batch(s, r, size=4) for r in range(2)))
        x, y = torch.cat(xs), torch.cat(ys)
        per = 8 // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


RESHARD_CFG = {
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "steps_per_print": 1000,
}


def _reshard_run(
    save_dir: str, first: int, n: int, save: bool, stage: int = 2, client: bool = False
) -> dict:
    """client: torch's AdamW object instead of the config's optimizer (its `step` is a
    tensor per parameter, which torch adds to in place)."""
    import os

    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.zero.zero_runs import Net

    world = int(os.environ["WORLD_SIZE"])
    zero = {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}
    cfg = {**RESHARD_CFG, "train_micro_batch_size_per_gpu": 8 // world, "zero_optimization": zero}
    model, opt = Net(), None
    if client:
        del cfg["optimizer"]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = initialize(model=model, config=cfg, optimizer=opt)
    if first:
        engine.load_checkpoint(save_dir)
    _global_steps(engine, first, n)
    if save:
        engine.save_checkpoint(save_dir)
    return full_state(engine.module)


@pytest.mark.parametrize(
    ("stage", "new_world", "client"),
    [(2, 1, False), (2, 4, False), (3, 1, False), (3, 4, False), (1, 1, True)],
    ids=["2-1", "2-4", "3-1", "3-4", "1-1-torch_adamw"],  # torch's: each chunk its own step
)
def test_resume_at_another_world_size(stage, new_world, client, tmp_path):
    args = (stage, client)
    want = run_ranks(_reshard_run, 2, str(tmp_path / "unused"), 0, 6, False, *args)[0]
    run_ranks(_reshard_run, 2, str(tmp_path), 0, 3, True, *args)
    got = run_ranks(_reshard_run, new_world, str(tmp_path), 3, 3, False, *args)
    for r in got[1:]:
        for n, p in r.items():
            assert torch.equal(p, got[0][n]), f"ranks diverged on {n}"
    moved = 0
    for n, p in got[0].items():
        torch.testing.assert_close(p, want[n], atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        moved += int(not torch.equal(p, Net_params()[n]))
    assert moved > 0


def Net_params() -> dict:  # noqa: N802 - reads as the module's initial params
    from tests.unit.zero.zero_runs import Net

    return {n: p.detach() for n, p in Net().named_parameters()}


def _stage2_into_stage3(save_dir: str, stage: int, how: str) -> dict:
    """Stage 2 trains a step and saves; stage 3 loads its whole module (module only, or
    without optimizer state), or is refused its optimizer state."""
    import os

    from deepspeed_ext.runtime.checkpoint import CheckpointError
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import GatheredParameters
    from tests.unit.zero.zero_runs import Net

    zero = {"stage": stage, "stage3_param_persistence_threshold": 10}  # head.bias kept whole
    cfg = {**RESHARD_CFG, "train_micro_batch_size_per_gpu": 4, "zero_optimization": zero}
    engine, *_ = initialize(model=Net(), config=cfg)
    if stage == 2:
        _global_steps(engine, 0, 1)
        engine.save_checkpoint(save_dir)
        return full_state(engine.module)
    try:
        if how == "module":
            engine.load_checkpoint(save_dir, load_module_only=True)
        else:
            engine.load_checkpoint(save_dir, load_optimizer_states=how == "full")
    except CheckpointError as e:
        return {"error": str(e)}
    with GatheredParameters(list(engine.module.parameters())):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _global_steps(engine, 1, 1)  # and it trains on
    return {"weights": got, "rank": int(os.environ["RANK"])}


def test_a_stage2_checkpoint_loads_its_weights_into_stage3(tmp_path):
    """Its model-states file holds the whole module: stage 3 cuts its shards and masters
    from it (it was refused, 'parameters partitioned by stage 3 load only into stage 3');
    the optimizer state, laid out by stage 2, is refused by name."""
    want = run_ranks(_stage2_into_stage3, 2, str(tmp_path), 2, "")[0]
    for how in ("module", "no_optimizer"):
        for r in run_ranks(_stage2_into_stage3, 2, str(tmp_path), 3, how):
            for n, v in want.items():
                assert torch.equal(r["weights"][n], v), (how, n)
    for r in run_ranks(_stage2_into_stage3, 2, str(tmp_path), 3, "full"):
        assert "load_optimizer_states=False" in r["error"], r
