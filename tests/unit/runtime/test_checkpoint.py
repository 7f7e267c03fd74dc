"""Checkpoints: exact resume, survival of a kill mid-save, and safe loading."""

import os
import pickle
import signal
import subprocess
import sys
import time

import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.subproc import env_with
from tests.unit.runtime.models import batch, loss_fn, mlp

CFG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 5e-3}},
    "steps_per_print": 1000,
}


def _train(engine, first_step: int, steps: int) -> list[float]:
    losses = []
    for s in range(first_step, first_step + steps):
        for m in range(engine.gradient_accumulation_steps()):
            x, y = batch(10 * s + m, 0)
            loss = loss_fn(engine, x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def _resume_run(
    save_dir: str,
) -> tuple[list[float], list[float], list[torch.Tensor], list[torch.Tensor]]:
    from deepspeed_ext.runtime.initialize import initialize

    full, *_ = initialize(model=mlp(seed=0), config=CFG)
    uninterrupted = _train(full, 0, 8)

    first, *_ = initialize(model=mlp(seed=0), config=CFG)
    _train(first, 0, 4)
    first.save_checkpoint(save_dir, client_state={"epoch": 3, "note": "hi"})
    second, *_ = initialize(model=mlp(seed=123), config=CFG)  # different init: load must fix it
    path, client = second.load_checkpoint(save_dir)
    assert client == {"epoch": 3, "note": "hi"}, client
    assert second.global_steps == 4 and path.endswith("global_step4")
    resumed = _train(second, 4, 4)
    return (
        uninterrupted[8:],
        resumed,
        [p.detach().clone() for p in full.module.parameters()],
        [p.detach().clone() for p in second.module.parameters()],
    )


def test_resume_reproduces_uninterrupted_run_exactly(tmp_path):
    ((want, got, p_full, p_resumed),) = run_ranks(_resume_run, 1, str(tmp_path))
    assert got == want, "resumed losses differ from the uninterrupted run"
    for a, b in zip(p_full, p_resumed):
        assert torch.equal(a, b)
    assert (tmp_path / "latest").read_text() == "global_step4"
    assert (tmp_path / "global_step4" / "mp_rank_00_model_states.pt").is_file()


SAVER = r"""
import sys, torch
from deepspeed_ext.runtime.initialize import initialize
from tests.unit.runtime.models import mlp
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
engine, *_ = initialize(model=mlp(), config=cfg)
engine.save_checkpoint(sys.argv[1], tag="good")
print("good saved", flush=True)
# a slow save: 400 MB of client state
engine.save_checkpoint(sys.argv[1], tag="bad", client_state={"blob": torch.ones(100 * 2**20)})
print("bad saved", flush=True)
"""


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tmp_path)],
        env=env_with(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / ".bad.tmp").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the second save never started"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    assert "bad saved" not in out, "the save finished before the kill; make it slower"
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    run_ranks(_load_good, 1, str(tmp_path))


def _load_good(save_dir: str) -> None:
    from deepspeed_ext.runtime.initialize import initialize

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = initialize(model=mlp(seed=5), config=cfg)
    path, _ = engine.load_checkpoint(save_dir)
    assert path.endswith("good")
    for a, b in zip(engine.module.parameters(), mlp(seed=0).parameters()):
        assert torch.equal(a, b)
    engine.save_checkpoint(save_dir, tag="again")  # a stale .bad.tmp must not get in the way


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _load_crafted(save_dir: str) -> str:
    from deepspeed_ext.runtime.checkpoint import CheckpointError
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(model=mlp(), config={"train_micro_batch_size_per_gpu": 1})
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_crafted_pickle_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "ckpt" / "evil"
    d.mkdir(parents=True)
    with open(d / "mp_rank_00_model_states.pt", "wb") as f:
        pickle.dump({"module": _Exploit(str(marker))}, f)
    (tmp_path / "ckpt" / "latest").write_text("evil")
    (msg,) = run_ranks(_load_crafted, 1, str(tmp_path / "ckpt"))
    assert "refusing to load" in msg
    assert not marker.exists(), "loading a checkpoint executed code"


def _unsafe_client_state(save_dir: str) -> str:
    from deepspeed_ext.runtime.checkpoint import CheckpointError
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(model=mlp(), config={"train_micro_batch_size_per_gpu": 1})
    try:
        engine.save_checkpoint(save_dir, client_state={"obj": object()})
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def test_unloadable_client_state_is_refused_at_save(tmp_path):
    (msg,) = run_ranks(_unsafe_client_state, 1, str(tmp_path))
    assert "client_state" in msg
    assert not (tmp_path / "latest").exists()


def _reserved_key(save_dir: str) -> str:
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(model=mlp(), config={"train_micro_batch_size_per_gpu": 1})
    try:
        engine.save_checkpoint(save_dir, client_state={"global_steps": 7})
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_client_state_may_not_overwrite_engine_keys(tmp_path):
    (msg,) = run_ranks(_reserved_key, 1, str(tmp_path))
    assert "global_steps" in msg and "reserved" in msg


def _mid_accumulation(save_dir: str) -> list[bool]:
    """Saves after micro-steps 1, 2 and 3 of a 3-step accumulation and after an Accelerate
    style batch: whether each warned; then a load mid-batch: whether it said it dropped the
    gradients, and whether the next batch equals one stepped from the file alone."""
    import logging

    import torch

    from deepspeed_ext.runtime.initialize import initialize

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = initialize(model=mlp(), config=config)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deepspeed_ext").addHandler(handler)
    warned = []

    def micro(i: int, step: bool = True) -> None:
        x = torch.randn(1, 16, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).pow(2).mean())
        if step:
            engine.step()

    def saved(tag: str) -> bool:
        seen.clear()
        engine.save_checkpoint(save_dir, tag=tag)
        return any("gradients this batch has accumulated" in m for m in seen)

    for i in range(3):
        micro(i)
        warned.append(saved(f"t{i}"))
    # Accelerate's way: the boundary set by hand, step() called at the boundary alone
    for i in range(3):
        engine.set_gradient_accumulation_boundary(i == 2)
        micro(10 + i, step=i == 2)
    warned.append(saved("accelerate"))
    # a load after half a batch drops that half: the next batch steps as from the file
    micro(20)
    seen.clear()
    engine.load_checkpoint(save_dir, tag="accelerate")
    dropped = any("dropped the gradients of 1 backward" in m for m in seen)
    for i in range(3):
        micro(30 + i)
    after = [p.detach().clone() for p in engine.module.parameters()]
    fresh, *_ = initialize(model=mlp(), config=config)
    fresh.load_checkpoint(save_dir, tag="accelerate")
    for i in range(3):
        x = torch.randn(1, 16, generator=torch.Generator().manual_seed(30 + i))
        fresh.backward(fresh(x).pow(2).mean())
        fresh.step()
    same = all(torch.equal(a, b.detach()) for a, b in zip(after, fresh.module.parameters()))
    return warned + [dropped, same]


def test_a_save_mid_accumulation_says_its_gradients_are_not_saved(tmp_path):
    """A checkpoint holds no gradients: saved mid-batch, the resume would step with the
    later micro-batches' alone; the save says so (it was silent), and a save at the
    boundary does not, however the boundary was reached (Accelerate calls step() at the
    boundary alone: the save warned). A load mid-batch drops the gradients accumulated
    before it (they leaked into the next step), and says so."""
    (warned,) = run_ranks(_mid_accumulation, 1, str(tmp_path))
    assert warned == [True, True, False, False, True, True]
