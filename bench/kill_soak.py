"""Soak: failures at random moments, measured (not a speed benchmark: it counts).

1. Crash during a checkpoint save: a 2-rank launcher job saves after every step; the whole
   job is SIGKILLed at a random moment inside a save (as a node losing power). The directory's
   `latest` must then name a complete checkpoint, which must load (in a world of one: at
   another world size).
2. A rank killed mid-step, mid-collective (its peer blocked in the step's all-reduce) and
   mid-save: the launcher must exit non-zero within 10 s leaving no rank alive.

    python bench/kill_soak.py --trials 20 --rank-trials 5   # -> bench/results/kill_soak.json
    python bench/kill_soak.py --smoke
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import machine_info, print_table, write_result

WORKER = Path(__file__).resolve().parent / "peers" / "kill_worker.py"


class Job:
    """A launcher job whose merged output is read line by line in the background."""

    def __init__(self, args: list[str]) -> None:
        launcher = shutil.which("deepspeed") or "deepspeed"
        cmd = [launcher, "--num_gpus", "2", "--master_port", "0", str(WORKER), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: killpg reaches every rank
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.pids: dict[int, int] = {}
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_for(self, prefix: str, timeout: float = 120) -> float:
        """Until a line starts with prefix; returns when it was seen."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.log.append(line)
            # two ranks share the pipe: lines can arrive glued together
            for pid, rank in re.findall(r"PID (\d+) RANK (\d+)", line):
                self.pids[int(rank)] = int(pid)
            if re.search(rf"(^|\D){re.escape(prefix)}(\D|$)", line):
                return time.monotonic()
        raise TimeoutError(f"no line {prefix!r}; last output: {self.log[-5:]}")

    def kill_all(self) -> None:
        """SIGKILL the launcher's group and every rank (the launcher may give ranks their
        own sessions), as a node losing power would; returns once all are gone."""
        while True:  # drain: a rank may have said its PID since
            try:
                self.wait_for("PID", timeout=0.01)
            except TimeoutError:
                break
        for pid in [self.proc.pid, *self.pids.values()]:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait()
        end = time.monotonic() + 10
        while any(_alive(p) for p in self.pids.values()) and time.monotonic() < end:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _verify(stage: int, ckpt: str) -> tuple[bool, str]:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    cmd = [sys.executable, str(WORKER), "--verify", "--stage", str(stage), "--ckpt", ckpt]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    loaded = [ln for ln in r.stdout.splitlines() if ln.startswith("LOADED")]
    return (r.returncode == 0 and bool(loaded)), (loaded[0] if loaded else r.stderr[-400:])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_crash(stage: int, rng: random.Random) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as ckpt:
        job = Job(["--stage", str(stage), "--ckpt", ckpt])
        try:
            began = job.wait_for("SAVE 1")
            save_s = job.wait_for("SAVED 1") - began
            target = rng.choice([2, 3])
            job.wait_for(f"SAVE {target}")
            delay = rng.uniform(0, 1.2 * save_s)
            time.sleep(delay)
        finally:
            job.kill_all()
        latest = Path(ckpt, "latest")
        tag = latest.read_text().strip() if latest.exists() else None
        ok, detail = _verify(stage, ckpt) if tag else (False, "no latest")
        return {
            "stage": stage,
            "killed_in_save": target,
            "delay_s": round(delay, 4),
            "save_s": round(save_s, 4),
            "latest": tag,
            "loads": ok,
            "detail": detail,
        }


def rank_kill(mode: str, rng: random.Random) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as ckpt:
        extra = ["--stall_rank", "1"] if mode == "mid-collective" else []
        job = Job(["--stage", "2", "--ckpt", ckpt, *extra])
        try:
            if mode == "mid-collective":
                job.wait_for("STALL")
                time.sleep(0.5)  # rank 0 is now blocked in the step's all-reduce
            elif mode == "mid-step":
                job.wait_for("STEP 3")
                time.sleep(rng.uniform(0, 0.05))
            else:
                job.wait_for("SAVE 3")
                time.sleep(rng.uniform(0, 0.05))
            while len(job.pids) < 2:  # both ranks have said their PIDs by step 3
                job.wait_for("PID", timeout=5)
            pids = list(job.pids.values())
            killed = time.monotonic()
            os.kill(job.pids[1], signal.SIGKILL)
            try:
                code = job.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                code = None
            exit_s = time.monotonic() - killed
            time.sleep(0.2)
            left = [p for p in pids if _alive(p)]
        finally:
            job.kill_all()
        return {
            "mode": mode,
            "exit_code": code,
            "exit_s": round(exit_s, 2),
            "ranks_left": len(left),
            "ok": code not in (0, None) and exit_s <= 10 and not left,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20, help="save crashes per ZeRO stage")
    ap.add_argument("--rank-trials", type=int, default=5, help="kills per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.rank_trials = 1, 1
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    saves = []
    for stage in (0, 1, 2, 3):
        for _ in range(args.trials):
            saves.append(save_crash(stage, rng))
        good = sum(s["loads"] for s in saves if s["stage"] == stage)
        print(f"  stage {stage}: {good}/{args.trials} loadable after a crash in a save", flush=True)
    kills = [
        rank_kill(m, rng)
        for m in ("mid-step", "mid-collective", "mid-save")
        for _ in range(args.rank_trials)
    ]
    rows = [[k["mode"], k["exit_code"], k["exit_s"], k["ranks_left"], k["ok"]] for k in kills]
    print_table(["rank killed", "launcher exit", "seconds", "ranks left", "ok"], rows)
    result = {
        "benchmark": "kill_soak",
        "workload": "2-rank launcher job, 8 x Linear(1024), AdamW, a checkpoint after every step",
        "machine": machine_info(),
        "save_crashes": saves,
        "save_crashes_loadable": sum(s["loads"] for s in saves),
        "save_crashes_total": len(saves),
        # latest names the save the kill fell in (it had committed) or the one before
        "latest_was_target": sum(s["latest"] == f"step{s['killed_in_save']}" for s in saves),
        "rank_kills": kills,
        "rank_kills_ok": sum(k["ok"] for k in kills),
        "wall_s": time.perf_counter() - t0,
    }
    path = write_result("kill_soak", result, smoke=args.smoke)
    print(
        f"{result['save_crashes_loadable']}/{len(saves)} loadable; "
        f"{result['rank_kills_ok']}/{len(kills)} rank kills handled; wrote {path}"
    )
    ok = result["save_crashes_loadable"] == len(saves) and result["rank_kills_ok"] == len(kills)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
