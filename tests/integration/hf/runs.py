"""Run examples/hf_trainer.py (which relaunches itself through our `deepspeed` launcher on 2 CPU
ranks) once per configuration and read what it wrote; every test of a configuration shares
its one run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.helpers.subproc import env_with

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
STEPS, SAVE_STEPS = 8, 4  # a checkpoint at step 4 to resume from, another at 8


def hf_missing() -> str | None:
    """Why the HF tests cannot run here, or None."""
    for name, pin in (("transformers", ">=5,<6"), ("accelerate", ">=1,<2")):
        if importlib.util.find_spec(name) is None:
            return f"{name}{pin} is not installed (pip install -e '.[test]')"
    try:
        importlib.metadata.metadata("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "the `deepspeed` distribution is not installed: transformers finds DeepSpeed by it"
    return None


def stage3_missing() -> str | None:
    """Why ZeRO 3 under the Trainer cannot run yet: it needs the deepspeed.zero face and a
    stage-3 strategy that gathers full weights (the hook in runtime/checkpoint/weights16.py)."""
    if importlib.util.find_spec("deepspeed_ext.zero.stage3") is None:
        return "deepspeed_ext has no ZeRO stage 3 yet"
    from deepspeed_ext.zero import stage3

    if importlib.util.find_spec("deepspeed.zero") is None:
        return "the deepspeed.zero face is not there yet"
    if not hasattr(getattr(stage3, "Stage3Strategy", None), "gathered_state_dict"):
        return "the stage-3 strategy cannot gather full weights yet (gathered_state_dict)"
    return None


@dataclass
class Run:
    out: Path
    log: str

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The Trainer's per-step log entries (loss, grad_norm, learning_rate, step)."""
        history = json.loads((self.out / "log_history.json").read_text())
        return [h for h in history if "loss" in h]

    def series(self, key: str) -> list[float]:
        return [float(h[key]) for h in self.steps]

    def weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.out / "final" / "model.safetensors"))


class Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Run] = {}

    def get(self, name: str, *flags: str, script: str = "hf_trainer.py") -> Run:
        if name not in self._done:
            out = self.root / name
            r = subprocess.run(
                [sys.executable, str(EXAMPLES / script), "--out", str(out), *flags],
                env=env_with(
                    DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
                ),
                cwd=self.root,
                capture_output=True,
                text=True,
                timeout=400,
            )
            log = r.stdout + r.stderr
            assert r.returncode == 0, f"{script} {' '.join(flags)} failed:\n{log[-6000:]}"
            self._done[name] = Run(out, log)
        return self._done[name]

    def trainer(self, name: str, *flags: str) -> Run:
        return self.get(name, "--steps", str(STEPS), "--save-steps", str(SAVE_STEPS), *flags)
