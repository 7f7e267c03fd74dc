"""NVMeSwapper round trips and check_nvme_path's errors (see [Note: NVMe swap files])."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_ext.zero.offload import NVMeSwapper, check_nvme_path
from deepspeed_ext.zero.offload import nvme as nvme_mod

pytestmark = pytest.mark.timeout(120, method="thread")  # a hang in C++ fails the run

KEY = "zero_optimization.offload_param.nvme_path"
AIO = {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 1, "single_submit": False}


@pytest.fixture(params=["io_uring", "threads"])
def swapper(request, tmp_path, monkeypatch):
    """A swapper on each async_io backend (io_uring falls back to threads where refused)."""
    monkeypatch.setenv("DS_AIO_IO_URING", "1" if request.param == "io_uring" else "0")
    s = NVMeSwapper(str(tmp_path), rank=1, tag="params", aio=AIO)
    if request.param == "threads":
        assert s._handle.backend() == "threads"
    yield s
    s.close()


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-128, 127, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_roundtrip_is_bit_exact(swapper, dtype):
    cases = {
        "one": (1,),
        "ragged": (4095,),
        "page": (4096,),
        "blocks": (3, 65537),
        "mb": (2**20 + 3,),
    }
    for i, (key, shape) in enumerate(cases.items()):
        src = _rand(shape, dtype, seed=i)
        swapper.swap_out(key, src)
        out = torch.full_like(src, 3)
        swapper.swap_in(key, out)
        assert torch.equal(out, src), key


def test_many_async_swaps_then_one_wait(swapper):
    srcs = {f"layer.{i}.weight": _rand((1000 + 37 * i,), torch.bfloat16, i) for i in range(24)}
    for k, t in srcs.items():
        swapper.swap_out(k, t, async_op=True)
    swapper.wait()
    outs = {k: torch.empty_like(t) for k, t in srcs.items()}
    for k, o in outs.items():
        swapper.swap_in(k, o, async_op=True)
    swapper.wait()
    for k in srcs:
        assert torch.equal(outs[k], srcs[k]), k
    assert swapper.nbytes_on_disk() == sum(t.numel() * 2 for t in srcs.values())


def test_background_reads_are_waited_for_on_their_own(swapper):
    """A background read (optimizer state read during the backward) is not completed by the
    foreground wait_reads() a parameter fetch makes, only by wait_reads(background=True);
    anything else touching its key first completes it."""
    a, b = _rand((4096,), torch.float32, 1), _rand((4096,), torch.float32, 2)
    swapper.swap_out("state", a)
    swapper.swap_out("shard", b)
    got_a, got_b = torch.empty_like(a), torch.empty_like(b)
    swapper.swap_in("state", got_a, async_op=True, background=True)
    swapper.swap_in("shard", got_b, async_op=True)
    swapper.wait_reads()
    assert torch.equal(got_b, b)
    assert set(swapper._bg.ops) == {"state"}, "the foreground wait left the background read alone"
    swapper.wait_reads(background=True)
    assert torch.equal(got_a, a) and not swapper._bg.ops
    # a write of a key whose background read is in flight waits for that read first
    swapper.swap_in("state", got_a, async_op=True, background=True)
    swapper.swap_out("state", b)
    assert not swapper._bg.ops
    again = torch.empty_like(b)
    swapper.swap_in("state", again)
    assert torch.equal(again, b)


def test_wait_read_completes_one_key_and_leaves_the_rest_in_flight(swapper):
    """A parameter fetch waits for its own shard's read, not for the read-ahead behind it
    (the shards after it stay in flight); a staged (non-contiguous) read is copied back by
    its own wait too."""
    srcs = {f"s{i}": _rand((64, 33), torch.float32, i) for i in range(4)}
    for k, t in srcs.items():
        swapper.swap_out(k, t)
    outs = {k: torch.empty_like(t) for k, t in srcs.items()}
    outs["s1"] = torch.empty(33, 64).t()  # not contiguous: staged, copied back at the wait
    for k, o in outs.items():
        swapper.swap_in(k, o, async_op=True)
    swapper.wait_read("s1")
    assert torch.equal(outs["s1"], srcs["s1"])
    assert set(swapper._reads.ops) == {"s0", "s2", "s3"}, "only s1's read was waited for"
    swapper.wait_read("s1")  # nothing in flight for it: a no-op
    swapper.wait_reads()
    assert not swapper._reads.ops
    for k in srcs:
        assert torch.equal(outs[k], srcs[k]), k


def test_a_read_that_cannot_start_leaves_nothing_staged(swapper):
    src = _rand((40, 30), torch.float32)
    swapper.swap_out("w", src)
    os.unlink(swapper._entries["w"].path)  # gone behind the swapper's back
    pooled = len(swapper._pool)
    with pytest.raises(RuntimeError, match="No such file"):
        swapper.swap_in("w", torch.empty(30, 40).t(), async_op=True)  # staged: not contiguous
    assert not swapper._reads.copy_back and not swapper._reads.ops
    assert len(swapper._pool) == pooled + 1  # its staging buffer went back


def test_non_contiguous_tensors_are_staged(swapper):
    src = _rand((300, 70), torch.float32).t()  # (70, 300), not contiguous
    swapper.swap_out("w", src, async_op=True)
    out = torch.empty(300, 70).t()
    swapper.swap_in("w", out, async_op=True)  # same key in flight: waits for the write first
    swapper.wait()
    assert torch.equal(out, src)
    assert len(swapper._pool) >= 1  # staging buffers went back to the pool


def test_unaligned_views_roundtrip(swapper):
    base = _rand((70001,), torch.float16)
    src = base[3:]  # contiguous, memory not on a page
    swapper.swap_out("v", src)
    out = torch.zeros(70003, dtype=torch.float16)[5:]
    swapper.swap_in("v", out)
    assert torch.equal(out, src)


def test_rewrite_with_fewer_bytes_shrinks_the_file(swapper):
    swapper.swap_out("k", torch.ones(10000))
    swapper.swap_out("k", torch.arange(10, dtype=torch.int8))
    files = list(Path(swapper.directory).iterdir())
    assert [f.stat().st_size for f in files] == [10]
    out = torch.empty(10, dtype=torch.int8)
    swapper.swap_in("k", out)
    assert torch.equal(out, torch.arange(10, dtype=torch.int8))


def test_swap_in_checks_name_the_key(swapper):
    swapper.swap_out("layer.3.bias", torch.zeros(5))
    with pytest.raises(ValueError, match=r"layer\.3\.bias.*4 elements.*5 elements"):
        swapper.swap_in("layer.3.bias", torch.empty(4))
    with pytest.raises(ValueError, match=r"torch\.float16.*torch\.float32"):
        swapper.swap_in("layer.3.bias", torch.empty(5, dtype=torch.float16))
    with pytest.raises(KeyError, match="never"):
        swapper.swap_in("never", torch.empty(5))


def test_files_live_under_rank_dir_and_close_removes_them(tmp_path):
    s = NVMeSwapper(str(tmp_path), rank=3, tag="optimizer", aio=AIO)
    s.swap_out("m", torch.zeros(100), async_op=True)
    root = tmp_path / "zero_stage_3" / "optimizer" / "rank3"
    assert Path(s.directory) == root
    s.close()  # waits for the async write first
    assert not (tmp_path / "zero_stage_3").exists()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.swap_out("m", torch.zeros(1))


def test_swappers_sharing_a_path_keep_their_own_files(tmp_path):
    """Two engines of one process given the same nvme_path (an RLHF actor and critic): the
    second took the first's directory, deleted its files as a crashed run's and wrote over
    its keys. A live swapper's directory is locked; the next takes rank<r>.1, and a crashed
    run's leftovers (no live owner) are still cleared."""
    root = tmp_path / "zero_stage_3" / "params"
    stale = root / "rank0" / "old.swp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    a = NVMeSwapper(str(tmp_path), 0, "params", aio=AIO)
    assert Path(a.directory) == root / "rank0" and not stale.exists()
    a.swap_out("k", torch.full((64,), 1.0))
    b = NVMeSwapper(str(tmp_path), 0, "params", aio=AIO)
    assert Path(b.directory) == root / "rank0.1"
    b.swap_out("k", torch.full((64,), 2.0))
    got_a, got_b = torch.empty(64), torch.empty(64)
    a.swap_in("k", got_a)
    b.swap_in("k", got_b)
    assert got_a.eq(1.0).all() and got_b.eq(2.0).all()
    a.close()
    c = NVMeSwapper(str(tmp_path), 0, "params", aio=AIO)  # rank0 is free again
    assert Path(c.directory) == root / "rank0"
    b.close()
    c.close()
    assert not (tmp_path / "zero_stage_3").exists()


def test_a_lock_taken_on_a_file_its_holder_was_unlinking_is_not_kept(tmp_path, monkeypatch):
    """A swapper that opened rank0.lock just before its holder unlinked it (releasing) got
    the lock on the unlinked file once the holder closed it: it owned rank0/ while the next
    swapper, locking the new rank0.lock, owned it too. Now a lock on a file no longer at
    that path is dropped and the path locked again."""
    tag = tmp_path / "zero_stage_3" / "params"
    real_flock, calls = nvme_mod.fcntl.flock, []

    def releasing_holder(fd, op):
        calls.append(fd)
        if len(calls) == 1:  # the holder ends: unlinks the file we opened, then a new one
            os.unlink(tag / "rank0.lock")
            (tag / "rank0.lock").touch()
        return real_flock(fd, op)

    monkeypatch.setattr(nvme_mod.fcntl, "flock", releasing_holder)
    d, fd = nvme_mod._own_directory(str(tag), 0)
    monkeypatch.undo()
    assert Path(d) == tag / "rank0" and len(calls) == 2
    assert os.fstat(fd).st_ino == os.stat(tag / "rank0.lock").st_ino
    b = NVMeSwapper(str(tmp_path), 0, "params", aio=AIO)  # rank0 is held: the next one
    assert Path(b.directory) == tag / "rank0.1"
    b.close()
    os.close(fd)


def test_files_removed_at_interpreter_exit(tmp_path):
    code = (
        "import torch\nfrom deepspeed_ext.zero.offload import NVMeSwapper\n"
        f"s = NVMeSwapper({str(tmp_path)!r}, 0, 'params')\n"
        "s.swap_out('a', torch.ones(1000), async_op=True)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not (tmp_path / "zero_stage_3").exists()


def test_aio_section_is_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown keys.*bogus"):
        NVMeSwapper(str(tmp_path), 0, "p", aio={"bogus": 1})
    with pytest.raises(ValueError, match="use_gds"):
        NVMeSwapper(str(tmp_path), 0, "p", aio={"use_gds": True})
    s = NVMeSwapper(str(tmp_path), 0, "p", aio={"thread_count": 2, "use_gds": False})
    assert s._handle.get_intra_op_parallelism() == 2
    s.close()


def test_check_nvme_path_creates_the_directory(tmp_path):
    p = tmp_path / "a" / "b"
    check_nvme_path(str(p), 1, KEY)
    assert p.is_dir() and not list(p.iterdir())  # the write probe is gone


def test_check_nvme_path_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=rf"{KEY}=.*file' is not a directory.*set {KEY}"):
        check_nvme_path(str(f), 1, KEY)


def test_check_nvme_path_unwritable(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):  # root: permissions do not stop it; sysfs does
            d = Path("/sys/kernel")
            if not d.is_dir() or os.access(d, os.W_OK) and _can_create(d):
                pytest.skip("no unwritable directory available to this user")
        with pytest.raises(ValueError, match=rf"{KEY}=.* is not writable \(.*\).*set {KEY}"):
            check_nvme_path(str(d), 1, KEY)
    finally:
        (tmp_path / "ro").chmod(0o700)


def _can_create(d: Path) -> bool:
    try:
        (d / ".ds_probe").touch()
    except OSError:
        return False
    (d / ".ds_probe").unlink()
    return True


def test_check_nvme_path_free_space(tmp_path, monkeypatch):
    class FakeStat:
        f_bavail, f_frsize = 1000, 4096  # 4.1 MB free

    monkeypatch.setattr(nvme_mod.os, "statvfs", lambda _: FakeStat())
    with pytest.raises(ValueError, match=rf"{KEY}=.*needs 5\.00 GB.*has 0\.00 GB free"):
        check_nvme_path(str(tmp_path), 5 * 10**9, KEY)
    check_nvme_path(str(tmp_path), 4096000, KEY)  # exactly enough
