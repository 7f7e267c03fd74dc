"""DS_BUILD_<OP>=1 puts the compiled op in the wheel, and load() then uses it (no JIT)."""

import subprocess
import sys
import zipfile

from deepspeed_ext.op_builder import CPULionBuilder
from tests.helpers.subproc import ROOT, env_with


def test_prebuilt_op_is_in_the_wheel_and_loads_without_jit(tmp_path):
    env = env_with(DS_BUILD_CPU_LION="1", DS_BUILD_OPS="0")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("deepspeed-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    lib = f"deepspeed_ext/ops/prebuilt/{CPULionBuilder().lib_name()}_op"
    assert any(n.startswith(lib) and n.endswith(".so") for n in names), names
    assert "deepspeed_ext/csrc/cpu_adam/cpu_adam_core.cpp" in names  # JIT sources ship too
    assert "deepspeed/ops/adam/__init__.py" in names

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import deepspeed_ext, torch\n"
        f"assert deepspeed_ext.__file__.startswith({str(site)!r}), deepspeed_ext.__file__\n"
        "from deepspeed_ext.ops.lion import DeepSpeedCPULion\n"
        "p = torch.nn.Parameter(torch.ones(40)); p.grad = torch.ones(40)\n"
        "DeepSpeedCPULion([p], lr=0.5).step()\n"
        "assert torch.allclose(p, torch.full((40,), 0.5))\n"
        # cpu_adam was not prebuilt: it JIT-builds from the csrc/ the wheel ships
        "from deepspeed_ext.op_builder import CPUAdamBuilder\n"
        "from deepspeed_ext.op_builder.builder import CSRC\n"
        f"assert str(CSRC).startswith({str(site)!r}), CSRC\n"
        "CPUAdamBuilder().load()\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env_with(DS_EXT_CACHE_DIR=str(tmp_path / "empty-cache")), "PYTHONPATH": str(site)},
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert "building op 'cpu_lion'" not in r.stderr, "a prebuilt op must not JIT-build"
    assert "built op 'cpu_adam'" in r.stderr
