"""ds_report lists every op, with a reason for each incompatible one, and works without
CUDA_HOME or nvcc on PATH."""

import json
import os
import re
import shutil
import subprocess
import sys

from deepspeed_ext.op_builder import ALL_OPS
from tests.helpers.subproc import env_with


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = env_with()
    env.pop("CUDA_HOME", None)
    # a PATH without nvcc on it
    env["PATH"] = os.pathsep.join(
        d for d in env["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, "nvcc"))
    )
    code = "from deepspeed_ext.env_report import cli_main; cli_main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_json_lists_every_op_with_reasons():
    r = _run("--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    names = [o["op"] for o in report["ops"]]
    assert names == list(ALL_OPS)
    for op in report["ops"]:
        assert op["compatible"] or op["reason"], op
    assert report["environment"]["simd"]["level"] in ("avx512", "avx2", "scalar")
    assert report["environment"]["torch"]["version"]


def test_text_report_names_ops_and_simd():
    r = _run()
    assert r.returncode == 0, r.stderr
    for name in ALL_OPS:
        assert name in r.stdout
        # the longest names ran into the next column ("sparse_attention_cuda[NO]")
        assert re.search(rf"^{name}\s+\[", r.stdout, re.M), name
    assert "SIMD level" in r.stdout and "ninja" in r.stdout


def test_console_script_is_installed():
    assert shutil.which("ds_report"), "pip install -e . should install the ds_report script"
