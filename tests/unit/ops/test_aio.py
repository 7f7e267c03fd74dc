"""The async_io op: bit-exact round trips through O_DIRECT and buffered I/O on both backends
(io_uring and the thread pool), async batches, and errors that name the file (see
[Note: aio pieces] and [Note: aio backends] in csrc/aio/aio_engine.h)."""

import ctypes
import gc
import json
import os
import platform
import re
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


# DS_AIO_IO_URING for each backend under test; "vectored" is io_uring with READV/WRITEV (the
# path of kernels before 5.6).
BACKENDS = {"io_uring": "1", "vectored": "vectored", "threads": "0"}


def _io_uring_refused() -> str:
    """'' when io_uring_setup works in this process (a probe independent of the op), else why."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"io_uring_setup's number is not known here ({platform.machine()})"
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(425, 1, params)  # __NR_io_uring_setup (x86_64 and aarch64 alike)
    if fd < 0:
        err = ctypes.get_errno()
        return f"io_uring_setup: {os.strerror(err)} (errno {err})"
    os.close(fd)
    return ""


URING_REFUSED = _io_uring_refused()


def _expect_backend(h, backend: str) -> None:
    """The handle runs the backend asked for, io_uring where this kernel offers it."""
    want = "threads" if backend == "threads" or URING_REFUSED else "io_uring"
    assert h.backend() == want, (backend, h.backend_reason())


@pytest.fixture(params=list(BACKENDS))
def backend(request, monkeypatch):
    """The backend new handles get (DS_AIO_IO_URING, read when a handle is made)."""
    monkeypatch.setenv("DS_AIO_IO_URING", BACKENDS[request.param])
    return request.param


@pytest.fixture(params=["direct", "buffered"])
def io(request, backend, disk_dir, monkeypatch):
    """(handle, directory) on each backend: O_DIRECT on a disk file system, or buffered
    (DS_AIO_DIRECT=0, the path a file system that refuses O_DIRECT takes)."""
    if request.param == "buffered":
        monkeypatch.setenv("DS_AIO_DIRECT", "0")
    else:
        monkeypatch.delenv("DS_AIO_DIRECT", raising=False)
    h = aio_handle(block_size=BS, queue_depth=4)
    yield h, disk_dir
    _expect_backend(h, backend)  # still: the ring never broke
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
def test_tmpfs_roundtrip_direct_or_fallback(backend):
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


def test_several_megabytes_default_block_size(backend, disk_dir):
    h = aio_handle()  # 1 MiB blocks
    src = _bytes(5 * 2**20 + 3)
    f = str(disk_dir / "big")
    h.sync_pwrite(src, f)
    back = torch.empty_like(src)
    h.sync_pread(back, f)
    assert torch.equal(back, src)
    _expect_backend(h, backend)


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


def test_wait_op_waits_for_its_request_alone(backend, disk_dir):
    # One piece in flight at a time (queue_depth 1), taken in submission order: the small
    # read submitted first finishes while the big one behind it has most of its pieces left.
    h = aio_handle(block_size=BS, queue_depth=1)
    small, big = _bytes(BS + 1, seed=1), _bytes(1024 * BS, seed=2)  # 2 pieces, 1024 pieces
    h.sync_pwrite(small, str(disk_dir / "small"))
    h.sync_pwrite(big, str(disk_dir / "big"))
    a, b = torch.empty_like(small), torch.empty_like(big)
    ia = h.submit_pread(a, str(disk_dir / "small"))
    ib = h.submit_pread(b, str(disk_dir / "big"))
    assert ib == ia + 1
    assert h.wait_op(ia) == 1
    assert h.pending_ops() == 1  # the big read is still running: wait_op did not wait for it
    assert torch.equal(a, small)
    assert h.wait_op(ib) == 1 and torch.equal(b, big)
    assert h.pending_ops() == 0 and h.wait_op(ia) == 1  # a finished request: at once
    assert h.wait() == 2  # wait() still counts what finished since the last wait()
    iw = h.submit_pwrite(small, str(disk_dir / "again"))
    h.wait()
    assert h.wait_op(iw) == 1  # waited for by wait() already


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_wait_op_raises_its_own_requests_error(backend, disk_dir):
    h = aio_handle(block_size=BS)
    good = h.submit_pwrite(_bytes(10), str(disk_dir / "fine"))
    bad = h.submit_pwrite(_bytes(3 * BS + 1), "/dev/full")
    assert h.wait_op(good) == 1  # the other request's failure is not this one's
    with pytest.raises(RuntimeError, match=r"'/dev/full'.*No space left on device \(errno 28\)"):
        h.wait_op(bad)
    assert h.wait() == 2  # each failure is reported once: wait_op(bad) took it
    again = h.submit_pwrite(_bytes(10), "/dev/full")
    with pytest.raises(RuntimeError, match="/dev/full"):
        h.wait()  # a failure nobody waited for alone goes to wait()
    assert h.wait_op(again) == 1  # ... and only once
    for wrong in (0, -1, again + 1):
        with pytest.raises(RuntimeError, match=rf"wait_op: id={wrong} was not returned"):
            h.wait_op(wrong)


def test_pread_pwrite_with_validate_and_async_flag(io):
    h, d = io
    src, f = _bytes(BS + 5), str(d / "v")
    assert h.pwrite(src, f, True, True) == 0
    assert h.wait() == 1
    back = torch.empty_like(src)
    assert h.pread(back, f, True, False) == 1
    assert torch.equal(back, src)
    assert h.write(src, f, False) == 1 and h.read(back, f, True, file_offset=0) == 1


def test_async_buffer_kept_alive_until_wait(backend, disk_dir):
    h = aio_handle(block_size=BS, queue_depth=1)  # one piece in flight: the second op waits
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
@pytest.mark.parametrize("depth", [1, 8])  # 1: the pieces after the failing one are skipped
def test_enospc_from_a_worker_is_raised_by_wait_then_handle_works(backend, disk_dir, depth):
    h = aio_handle(block_size=BS, queue_depth=depth)
    h.async_pwrite(_bytes(3 * BS + 1), "/dev/full")
    h.async_pwrite(_bytes(10), str(disk_dir / "fine"))
    with pytest.raises(RuntimeError, match=r"'/dev/full'.*No space left on device \(errno 28\)"):
        h.wait()
    assert h.sync_pwrite(_bytes(10), str(disk_dir / "after")) == 1  # error state was reset
    assert (disk_dir / "fine").stat().st_size == 10  # the other request still ran


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
    # The pool has queue_depth * intra_op_parallelism threads; io_uring one ring thread.
    threads = 1 if h.backend() == "io_uring" else 6
    assert h.get_alignment() == 4096 and h.get_thread_count() == threads
    t = h.new_cpu_locked_tensor(1001, torch.empty(0, dtype=torch.bfloat16))
    assert t.shape == (1001,) and t.dtype == torch.bfloat16 and t.data_ptr() % 4096 == 0
    t.fill_(1.5)  # the memory is usable
    assert h.free_cpu_locked_tensor(t) and not h.free_cpu_locked_tensor(t)
    assert not h.free_cpu_locked_tensor(torch.empty(3))
    d = aio_handle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_single_submit()) == (2**20, 8, False)


def test_backend_is_io_uring_where_the_kernel_offers_it(monkeypatch):
    monkeypatch.delenv("DS_AIO_IO_URING", raising=False)
    if URING_REFUSED:
        pytest.skip(f"the kernel refuses io_uring here: {URING_REFUSED}")
    h = aio_handle(queue_depth=3, intra_op_parallelism=2)
    assert (h.backend(), h.backend_reason(), h.get_thread_count()) == ("io_uring", "", 1)


def test_env_picks_the_backend(monkeypatch):
    monkeypatch.setenv("DS_AIO_IO_URING", "0")
    h = aio_handle(queue_depth=3, intra_op_parallelism=2)
    assert (h.backend(), h.get_thread_count()) == ("threads", 6)
    assert h.backend_reason() == "io_uring turned off (DS_AIO_IO_URING=0)"
    monkeypatch.setenv("DS_AIO_IO_URING", "vectored")
    v = aio_handle()
    if not URING_REFUSED:
        assert v.backend() == "io_uring" and "READV/WRITEV" in v.backend_reason()
    monkeypatch.setenv("DS_AIO_IO_URING", "yes")
    with pytest.raises(RuntimeError, match=r"DS_AIO_IO_URING=yes is not one of"):
        aio_handle()


# An LD_PRELOAD shim makes syscall(SHIM_NR, ...) fail with errno SHIM_ERRNO after the first
# SHIM_AFTER such calls, as a seccomp filter or kernel.io_uring_disabled (EPERM) or a kernel
# before 5.1 (ENOSYS) would. Other calls go to the real syscall() with six argument words
# (callers that pass fewer ignore the rest, as glibc's own syscall() does).
_SYSCALL_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
static long calls;
long syscall(long n, ...) {
  va_list a;
  long x[6];
  va_start(a, n);
  for (int i = 0; i < 6; i++) x[i] = va_arg(a, long);
  va_end(a);
  const char* nr = getenv("SHIM_NR");
  const char* after = getenv("SHIM_AFTER");
  if (nr && n == atol(nr) && __atomic_fetch_add(&calls, 1, __ATOMIC_SEQ_CST) >= atol(after)) {
    errno = atoi(getenv("SHIM_ERRNO"));
    return -1;
  }
  long (*real)(long, ...) = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  return real(n, x[0], x[1], x[2], x[3], x[4], x[5]);
}
"""

# Round trips on two handles, each 8 requests in flight at once; prints each handle's backend.
_ROUND_TRIPS = """
import torch
from deepspeed_ext.ops.aio import aio_handle
srcs = [torch.randint(0, 256, (300001 + i,), dtype=torch.uint8) for i in range(8)]
for i in range(2):
    h = aio_handle(block_size=65536)
    for j, s in enumerate(srcs):
        h.async_pwrite(s, f"{DIR}/f{i}_{j}", file_offset=100)
    assert h.wait() == len(srcs)
    backs = [torch.empty_like(s) for s in srcs]
    for j, b in enumerate(backs):
        h.async_pread(b, f"{DIR}/f{i}_{j}", file_offset=100)
    assert h.wait() == len(srcs)
    assert all(torch.equal(b, s) for b, s in zip(backs, srcs))
    print("BACKEND", h.backend(), h.get_thread_count(), h.backend_reason())
"""


def _round_trips_with_shim(tmp_path, d, nr: int, err: int, after: int) -> list[str]:
    (tmp_path / "shim.c").write_text(_SYSCALL_SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", shim, tmp_path / "shim.c", "-ldl"], check=True)
    env = {"LD_PRELOAD": str(shim), "SHIM_NR": str(nr), "SHIM_ERRNO": str(err)}
    r = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIPS.replace("{DIR}", str(d))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DS_AIO_IO_URING": "1", "SHIM_AFTER": str(after), **env},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("BACKEND")]
    assert len(lines) == 2, r.stdout
    return lines + [r.stderr]


_NO_SHIM = URING_REFUSED or ("" if shutil.which("cc") else "no C compiler")
needs_shim = pytest.mark.skipif(bool(_NO_SHIM), reason=f"needs io_uring and cc: {_NO_SHIM}")


@pytest.mark.parametrize(
    "nr, err, why",
    [
        (425, 38, r"io_uring_setup: Function not implemented \(errno 38\)"),
        (425, 1, r"io_uring_setup: Operation not permitted \(errno 1\)"),
        (426, 1, r"io_uring_enter: Operation not permitted \(errno 1\)"),  # setup allowed
    ],
    ids=["setup-ENOSYS", "setup-EPERM", "enter-EPERM"],
)
@needs_shim
def test_io_uring_refused_falls_back_to_threads_once(tmp_path, disk_dir, nr, err, why):
    *lines, stderr = _round_trips_with_shim(tmp_path, disk_dir, nr, err, after=0)
    for line in lines:
        assert line.startswith("BACKEND threads 8 io_uring unavailable: "), line
        assert re.search(why, line), line
    assert stderr.count("using pread/pwrite threads") == 1, stderr  # one line per process


@needs_shim
def test_io_uring_enter_failing_mid_run_leaves_no_waiter(tmp_path, disk_dir):
    """io_uring_enter fails for good after the setup's NOP and two submissions, with SQEs in
    the kernel and more queued: those finish, the rest moves with pread/pwrite, bit-exact."""
    *lines, stderr = _round_trips_with_shim(tmp_path, disk_dir, 426, 14, after=3)
    want = "BACKEND threads 1 io_uring_enter failed: Bad address (errno 14)"
    assert lines[0].startswith(want), lines[0]
    assert lines[1].startswith("BACKEND threads 8 io_uring unavailable: io_uring_enter"), lines
    assert "using pread/pwrite on the ring thread" in stderr, stderr


# RLIMIT_FSIZE cuts a write that crosses the limit short; the rest, resubmitted, fails with
# EFBIG at the limit (Python ignores SIGXFSZ). The op is loaded before the limit is set.
_SHORT_WRITE = r"""
import json, os, resource, sys, torch
from deepspeed_ext.ops.aio import aio_handle
d, limit = sys.argv[1], int(sys.argv[2])
aio_handle()
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
src = torch.randint(0, 256, (2 * 65536,), dtype=torch.uint8)
out = {}
for backend in ("1", "vectored", "0"):
    for direct in ("1", "0"):
        os.environ["DS_AIO_IO_URING"], os.environ["DS_AIO_DIRECT"] = backend, direct
        h = aio_handle(block_size=65536)
        f = os.path.join(d, f"w{backend}{direct}")
        try:
            h.sync_pwrite(src, f)
            err = ""
        except RuntimeError as e:
            err = str(e)
        with open(f, "rb") as fh:
            ok = fh.read() == src[:limit].numpy().tobytes()
        size = os.path.getsize(f)
        out[f"{backend}/{direct}"] = {"backend": h.backend(), "error": err, "size": size, "ok": ok}
print(json.dumps(out))
"""


def test_short_writes_resubmit_the_rest(disk_dir):
    """A write cut short goes on from where it stopped, on every backend, direct and buffered:
    the bytes before the limit are on disk and the error names the limit's offset."""
    limit = 65536 + 16384  # inside the second 64 KiB piece, on the alignment
    r = subprocess.run(
        [sys.executable, "-c", _SHORT_WRITE, str(disk_dir), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert len(res) == 6, res
    for case, got in res.items():
        want = "threads" if case.startswith("0/") or URING_REFUSED else "io_uring"
        assert got["backend"] == want, (case, got)
        pattern = rf"write of '.*/w[^']*' .* failed: .*write at file offset {limit}: File too large"
        assert re.search(pattern, got["error"]), (case, got)
        assert got["size"] == limit and got["ok"], (case, got)


def test_upstream_import_paths():
    import deepspeed.ops.aio
    from deepspeed.ops.op_builder import AsyncIOBuilder as Face

    assert Face is AsyncIOBuilder and deepspeed.ops.aio.AsyncIOBuilder is AsyncIOBuilder
