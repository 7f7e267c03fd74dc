"""The async_io op: bit-exact round trips through O_DIRECT and buffered I/O, async batches,
and errors that name the file (see [Note: aio pieces] in csrc/aio/aio_engine.h)."""

import gc
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from deepspeed_ext.op_builder import ALL_OPS, AsyncIOBuilder
from deepspeed_ext.ops.aio import aio_handle

pytestmark = pytest.mark.timeout(120, method="thread")  # a hang in C++ fails the run

BS = 64 * 1024  # small block size: many pieces per op, small files
# Bytes: the alignment edges, block_size edges, and a few blocks with both ragged ends.
SIZES = [1, 4095, 4096, 4097, BS - 1, BS, BS + 1, 3 * BS + 4097]


def _fs_type(path: Path) -> str:
    """File system type of the mount holding `path` (longest mount-point prefix)."""
    best, fs = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        mnt = parts[1].replace("\\040", " ")
        if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
            best, fs = mnt, parts[2]
    return fs


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a disk-backed file system (/tmp may be tmpfs)."""
    if _fs_type(tmp_path) not in ("tmpfs", "ramfs"):
        yield tmp_path
        return
    base = Path.home() / ".cache" / "deepspeed_ext"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="aio_test_", dir=base))
    if _fs_type(d) in ("tmpfs", "ramfs"):
        shutil.rmtree(d)
        pytest.skip("no disk-backed directory to test O_DIRECT on")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["direct", "buffered"])
def io(request, disk_dir, monkeypatch):
    """(handle, directory): O_DIRECT on a disk file system, or buffered (DS_AIO_DIRECT=0,
    the path a file system that refuses O_DIRECT takes)."""
    if request.param == "buffered":
        monkeypatch.setenv("DS_AIO_DIRECT", "0")
    else:
        monkeypatch.delenv("DS_AIO_DIRECT", raising=False)
    h = aio_handle(block_size=BS, queue_depth=4)
    yield h, disk_dir
    if request.param == "buffered":
        assert "turned off" in h.buffered_reason()
    elif _takes_o_direct(disk_dir):
        assert h.buffered_reason() == "", "O_DIRECT was not used where the file system takes it"
    else:  # e.g. a file system without O_DIRECT under the test's tmp dir: the fallback ran
        assert "refuses O_DIRECT" in h.buffered_reason()


def _takes_o_direct(d: Path) -> bool:
    try:
        fd = os.open(d / "odirect_probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(d / "odirect_probe")
    return True


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _unaligned(src: torch.Tensor) -> torch.Tensor:
    """A copy of `src` whose memory does not start on a page (forces the bounce path)."""
    big = torch.empty(src.numel() + 8192, dtype=torch.uint8)
    skip = (4096 - big.data_ptr() % 4096) % 4096 + 1
    out = big[skip : skip + src.numel()]
    out.copy_(src)
    assert out.data_ptr() % 4096 != 0
    return out


def test_registered_and_compatible_without_libaio():
    assert ALL_OPS["async_io"] is AsyncIOBuilder
    assert bool(AsyncIOBuilder().is_compatible()) == (platform.system() == "Linux")


@pytest.mark.parametrize("offset", [0, 4096, 1234])
def test_roundtrip_every_size(io, offset):
    h, d = io
    for i, n in enumerate(SIZES):
        src = _bytes(n, seed=i)
        for aligned in (True, False):
            mem = h.new_cpu_locked_tensor(n, src) if aligned else _unaligned(src)
            mem.copy_(src)
            f = str(d / f"s{n}_{aligned}")
            assert h.sync_pwrite(mem, f, file_offset=offset) == 1
            assert os.path.getsize(f) == offset + n
            back = (
                h.new_cpu_locked_tensor(n, src)
                if aligned
                else _unaligned(torch.zeros(n, dtype=torch.uint8))
            )
            back.zero_()
            assert h.sync_pread(back, f, file_offset=offset) == 1
            assert torch.equal(back, src), (n, aligned, offset)


@pytest.mark.skipif(_fs_type(Path("/dev/shm/x")) != "tmpfs", reason="needs a tmpfs /dev/shm")
def test_tmpfs_roundtrip_direct_or_fallback():
    """tmpfs refuses O_DIRECT before Linux 6.6 (EINVAL at open: the fallback) and takes it
    since; either way the bytes come back, and the reason says which happened."""
    d = Path(tempfile.mkdtemp(prefix="aio_test_", dir="/dev/shm"))
    try:
        h = aio_handle(block_size=BS)
        for i, n in enumerate([4095, BS + 1, 2 * BS]):
            src = _bytes(n, seed=i)
            h.sync_pwrite(src, str(d / "t"), file_offset=4096 * i)
            back = torch.empty_like(src)
            h.sync_pread(back, str(d / "t"), file_offset=4096 * i)
            assert torch.equal(back, src)
        refused = not _takes_o_direct(d)
        assert ("refuses O_DIRECT" in h.buffered_reason()) == refused, h.buffered_reason()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# An LD_PRELOAD shim makes open() refuse O_DIRECT (EINVAL) under */nodirect/*, as tmpfs
# before Linux 6.6 and some FUSE file systems do.
_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
static int pick(const char* sym, const char* p, int flags, mode_t m) {
  if ((flags & O_DIRECT) && strstr(p, "/nodirect/")) { errno = EINVAL; return -1; }
  int (*real)(const char*, int, ...) = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, sym);
  return real(p, flags, m);
}
#define OPEN(name) int name(const char* p, int f, ...) { va_list a; va_start(a, f); \
  mode_t m = (mode_t)va_arg(a, int); va_end(a); return pick(#name, p, f, m); }
OPEN(open)
OPEN(open64)
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_einval_at_open_falls_back_to_buffered_once(tmp_path):
    (tmp_path / "shim.c").write_text(_SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", shim, tmp_path / "shim.c", "-ldl"], check=True)
    (tmp_path / "nodirect").mkdir()
    code = (
        "import torch\nfrom deepspeed_ext.ops.aio import aio_handle\n"
        "h = aio_handle(block_size=65536)\n"
        "src = torch.randint(0, 256, (300001,), dtype=torch.uint8)\n"
        f"for f in ('a', 'b'):\n    p = {str(tmp_path / 'nodirect')!r} + '/' + f\n"
        "    h.sync_pwrite(src, p, file_offset=100)\n"
        "    back = torch.empty_like(src)\n"
        "    h.sync_pread(back, p, file_offset=100)\n"
        "    assert torch.equal(back, src)\n"
        "print('REASON', h.buffered_reason())\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LD_PRELOAD": str(shim)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REASON the file system of" in r.stdout and "refuses O_DIRECT (open: " in r.stdout
    assert r.stderr.count("using buffered I/O") == 1, r.stderr  # one line per process


def test_several_megabytes_default_block_size(disk_dir):
    h = aio_handle()  # 1 MiB blocks
    src = _bytes(5 * 2**20 + 3)
    f = str(disk_dir / "big")
    h.sync_pwrite(src, f)
    back = torch.empty_like(src)
    h.sync_pread(back, f)
    assert torch.equal(back, src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_dtypes_bit_exact(io, dtype):
    h, d = io
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[
        torch.empty(0, dtype=dtype).element_size()
    ]
    # Random bit patterns: NaN payloads, infinities and subnormals must come back unchanged.
    n = 3 * BS // 2 + 7
    raw = _bytes(n * torch.empty(0, dtype=dtype).element_size(), seed=7)
    src = raw.view(dtype)
    f = str(d / "t.bin")
    h.sync_pwrite(src, f)
    back = torch.empty_like(src)
    h.sync_pread(back, f)
    assert torch.equal(back.view(bits), src.view(bits))


def test_writes_at_offsets_keep_the_rest_of_the_file(io):
    h, d = io
    f = str(d / "shared.bin")
    a, b = _bytes(10000, 1), _bytes(BS + 3, 2)
    h.sync_pwrite(a, f)
    h.sync_pwrite(b, f, file_offset=5000)
    whole = torch.empty(5000 + BS + 3, dtype=torch.uint8)
    h.sync_pread(whole, f)
    assert torch.equal(whole[:5000], a[:5000])
    assert torch.equal(whole[5000:], b)


def test_many_async_ops_then_one_wait(io):
    h, d = io
    srcs = [_bytes(SIZES[i % len(SIZES)] + i, seed=i) for i in range(48)]
    for i, s in enumerate(srcs):
        assert h.async_pwrite(s, str(d / f"f{i}")) == 0
    assert h.wait() == len(srcs)
    backs = [torch.zeros_like(s) for s in srcs]
    for i, b in enumerate(backs):
        assert h.async_pread(b, str(d / f"f{i}")) == 0
    assert h.wait() == len(srcs)
    assert h.wait() == 0  # nothing pending
    for s, b in zip(srcs, backs):
        assert torch.equal(s, b)


def test_pread_pwrite_with_validate_and_async_flag(io):
    h, d = io
    src, f = _bytes(BS + 5), str(d / "v")
    assert h.pwrite(src, f, True, True) == 0
    assert h.wait() == 1
    back = torch.empty_like(src)
    assert h.pread(back, f, True, False) == 1
    assert torch.equal(back, src)
    assert h.write(src, f, False) == 1 and h.read(back, f, True, file_offset=0) == 1


def test_async_buffer_kept_alive_until_wait(disk_dir):
    h = aio_handle(block_size=BS, queue_depth=1)  # one worker: the second op waits its turn
    n = 40 * 2**20  # past glibc's largest mmap threshold: a freed buffer leaves the heap
    h.async_pwrite(torch.zeros(n // 2, dtype=torch.uint8), str(disk_dir / "first"))
    expect = _bytes(n, 3)
    h.async_pwrite(expect.clone(), str(disk_dir / "second"))  # the only reference: the op's
    gc.collect()
    torch.full((n,), 7, dtype=torch.uint8)  # would reuse the memory, were it freed
    h.wait()
    back = torch.empty_like(expect)
    h.sync_pread(back, str(disk_dir / "second"))
    assert torch.equal(back, expect)


def test_reading_a_short_file_names_file_and_sizes(disk_dir):
    h = aio_handle()
    f = str(disk_dir / "short")
    h.sync_pwrite(_bytes(100), f)
    with pytest.raises(RuntimeError, match=r"short' has 100 bytes.*200 bytes.*needs 200"):
        h.sync_pread(torch.empty(200, dtype=torch.uint8), f)
    with pytest.raises(RuntimeError, match=r"needs 150"):
        h.async_pread(torch.empty(100, dtype=torch.uint8), f, file_offset=50)
    with pytest.raises(RuntimeError, match=r"missing.*No such file"):
        h.sync_pread(torch.empty(1, dtype=torch.uint8), str(disk_dir / "missing"))
    assert h.wait() == 0  # rejected ops were never queued


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_enospc_from_a_worker_is_raised_by_wait_then_handle_works(disk_dir):
    h = aio_handle(block_size=BS)
    h.async_pwrite(_bytes(3 * BS + 1), "/dev/full")
    h.async_pwrite(_bytes(10), str(disk_dir / "fine"))
    with pytest.raises(RuntimeError, match=r"'/dev/full'.*No space left on device \(errno 28\)"):
        h.wait()
    assert h.sync_pwrite(_bytes(10), str(disk_dir / "after")) == 1  # error state was reset


def test_input_checks_name_the_problem(disk_dir):
    h = aio_handle()
    f = str(disk_dir / "x")
    with pytest.raises(RuntimeError, match="not contiguous"):
        h.sync_pwrite(torch.zeros(8, 8).t(), f)
    with pytest.raises(RuntimeError, match="file_offset=-1"):
        h.sync_pwrite(torch.zeros(8), f, file_offset=-1)
    with pytest.raises(RuntimeError, match=r"directory '.*nodir'.*No such file"):
        h.sync_pwrite(torch.zeros(8), str(disk_dir / "nodir" / "x"))
    with pytest.raises(RuntimeError, match="it is a directory"):
        h.sync_pwrite(torch.zeros(8), str(disk_dir))
    with pytest.raises(RuntimeError, match="filename is empty"):
        h.sync_pwrite(torch.zeros(8), "")
    with pytest.raises(RuntimeError, match="queue_depth=0"):
        aio_handle(queue_depth=0)


def test_locked_tensor_and_getters():
    h = (
        AsyncIOBuilder()
        .load()
        .aio_handle(
            block_size=BS,
            queue_depth=3,
            single_submit=True,
            overlap_events=True,
            intra_op_parallelism=2,
        )
    )
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (BS, 3, 2)
    assert h.get_single_submit() and h.get_overlap_events()
    assert h.get_alignment() == 4096 and h.get_thread_count() == 6
    t = h.new_cpu_locked_tensor(1001, torch.empty(0, dtype=torch.bfloat16))
    assert t.shape == (1001,) and t.dtype == torch.bfloat16 and t.data_ptr() % 4096 == 0
    t.fill_(1.5)  # the memory is usable
    assert h.free_cpu_locked_tensor(t) and not h.free_cpu_locked_tensor(t)
    assert not h.free_cpu_locked_tensor(torch.empty(3))
    d = aio_handle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_single_submit()) == (2**20, 8, False)


def test_upstream_import_paths():
    import deepspeed.ops.aio
    from deepspeed.ops.op_builder import AsyncIOBuilder as Face

    assert Face is AsyncIOBuilder and deepspeed.ops.aio.AsyncIOBuilder is AsyncIOBuilder
