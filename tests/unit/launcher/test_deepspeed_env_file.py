"""`.deepspeed_env` end to end: what accelerate's `accelerate launch` appends to
./.deepspeed_env (upstream's DEEPSPEED_ENVIRONMENT_NAME) reaches every rank the launcher starts,
and the working directory's file overrides the one in $HOME."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.subproc import env_with


def test_every_rank_gets_the_deepspeed_env_variables(tmp_path):
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / DEEPSPEED_ENVIRONMENT_NAME).write_text("FROM_HOME=1\nSHARED=home\n")
    (work / DEEPSPEED_ENVIRONMENT_NAME).write_text("SHARED=work\nNCCL_TEST_FLAG=yes\n")
    script = work / "show.py"
    script.write_text(
        "import os\n"
        "keys = ('RANK', 'FROM_HOME', 'SHARED', 'NCCL_TEST_FLAG')\n"
        "line = ' '.join(['ENV', *[str(os.environ.get(k)) for k in keys]])\n"
        "# one write: ranks run unbuffered (-u), and a print's pieces from two ranks interleave\n"
        "os.write(1, (line + '\\n').encode())\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "deepspeed_ext.launcher.runner", "--num_gpus", "2", str(script)],
        cwd=work,
        env=env_with(DS_ACCELERATOR="cpu", HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    seen = sorted(ln.split("ENV ", 1)[1] for ln in r.stdout.splitlines() if "ENV " in ln)
    assert seen == ["0 1 work yes", "1 1 work yes"], r.stdout
