"""The README's two commands stay what CI and users run; the main job trains for real."""

import re
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    block = re.search(
        r"## Set up and run.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S
    )
    assert block, "README lost its set-up block"
    return [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"TEST_CMD='{cmds[1]}'" in ci, "the .ci/run test command must be the README's"


def test_main_job_trains_on_two_ranks_and_writes_checkpoint_and_png(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_tiny_gpt.py"),
            "--steps",
            "120",
            "--print-every",
            "20",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "2 rank(s)" in log and "2 ranks x micro-batch" in log
    assert "samples/s" in log and "tokens/s" in log and "peak mem" in log
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (800, 450)  # IHDR: matplotlib's 8 x 4.5 in
    # the recorded run reads back through the report command
    from deepspeed_ext.env_report import main as ds_report

    # each rank's window times, for the report's stragglers
    assert sorted(p.name for p in (out / "metrics" / "ranks").iterdir()) == [
        "rank0.jsonl",
        "rank1.jsonl",
    ]
    assert ds_report(["run", str(out), "--out", str(tmp_path / "report")]) == 0
    assert {p.name for p in (tmp_path / "report").glob("*.png")} == {
        "loss_lr.png",
        "throughput.png",
        "memory.png",
    }
    import torch

    ckpt = torch.load(
        out / "checkpoints" / "global_step120" / "mp_rank_00_model_states.pt", weights_only=True
    )
    assert ckpt["global_steps"] == 120 and ckpt["dp_world_size"] == 2 and ckpt["seed"] == 0
