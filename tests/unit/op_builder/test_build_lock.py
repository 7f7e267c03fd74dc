"""A build killed halfway must not block later builds; concurrent loaders build once."""

import os
import signal
import time
from pathlib import Path

from tests.helpers.subproc import popen

LOAD_LION = (
    "from deepspeed_ext.op_builder import CPULionBuilder\n"
    "op = CPULionBuilder().load()\n"
    "print('loaded', op.simd_level())\n"
)


def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_killed_build_then_concurrent_loads_complete(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    first = popen(LOAD_LION, DS_EXT_CACHE_DIR=cache)
    # Wait until torch's own build has started (its O_EXCL baton exists), then kill the
    # builder and its compiler children halfway.
    batons = lambda: list(Path(cache).glob("*/cpu_lion_*/lock"))  # noqa: E731
    assert _wait_for(lambda: bool(batons()), 120), first.communicate(timeout=60)
    time.sleep(1.0)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    assert batons(), "the killed build should have left torch's lock behind"
    assert not list(Path(cache).glob("*/cpu_lion_*/stamp")), "a killed build is not complete"

    # Two loaders at once: the stale lock is ignored, one builds, the other waits for it.
    a = popen(LOAD_LION, DS_EXT_CACHE_DIR=cache)
    b = popen(LOAD_LION, DS_EXT_CACHE_DIR=cache)
    out_a, err_a = a.communicate(timeout=400)
    out_b, err_b = b.communicate(timeout=400)
    assert a.returncode == 0 and b.returncode == 0, (err_a, err_b)
    assert "loaded" in out_a and "loaded" in out_b
    builds = (err_a + err_b).count("built op 'cpu_lion'")
    assert builds == 1, f"expected exactly one build, saw {builds}:\n{err_a}\n{err_b}"
