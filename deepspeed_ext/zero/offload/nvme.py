"""The NVMe tier of ZeRO-Infinity: tensors swapped to files through the async_io op.

[Note: NVMe swap files]
Each swapper owns <nvme_path>/zero_stage_3/<tag>/rank<rank>/, one file per key, removed on
close() and at interpreter exit. It holds a lock on the directory while it lives: a second
swapper of the same path, tag and rank (two engines of one process, an RLHF actor and critic,
or another job on the machine) takes rank<rank>.1/ and so on, where it used to delete the
first one's files as a crashed run's leftovers and read and write its keys.
The bytes on disk are the tensor's raw bytes (any dtype); the swapper remembers numel and
dtype per key, and swap_in checks them. Contiguous CPU tensors go to the op as they are (it
bounces unaligned memory through page-aligned buffers itself); device or non-contiguous
tensors are staged through a small pool of page-aligned buffers. An async op's tensors must
stay untouched until wait(); an op on a key that is still in flight waits first, so a read
never overtakes the write of the same key.
Not thread-safe: one swapper per training thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.ops.aio import AioHandle, aio_handle

_AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")
_POOL_MAX = 4  # staging buffers kept for reuse after wait()


def check_nvme_path(path: str, needed_bytes: int, key: str) -> None:
    """At initialize: `path` is (made) a writable directory whose file system has at least
    `needed_bytes` free. Raises a ValueError naming the config `key`, the path and the fix."""
    fix = f"set {key} to a writable directory on a local NVMe drive with enough free space"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{key}={path!r} is not a directory; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{key}={path!r} cannot be created ({e.strerror}); {fix}") from None
    try:  # a real file: os.access says yes to root on a read-only file system
        fd, probe = tempfile.mkstemp(prefix=".ds_nvme_probe_", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{key}={path!r} is not writable ({e.strerror}); {fix}") from None
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < needed_bytes:
        raise ValueError(
            f"{key}={path!r}: NVMe offload needs {needed_bytes / 1e9:.2f} GB but its file "
            f"system has {free / 1e9:.2f} GB free; free up space there or {fix}"
        )


def aio_settings(section: Any) -> dict[str, Any]:
    """The typed `aio` config section as the handle's keyword arguments (use_gds is refused
    when the config is parsed)."""
    return {k: getattr(section, k) for k in _AIO_KEYS}


def _aio_kwargs(aio: Mapping[str, Any] | None) -> dict[str, Any]:
    cfg = dict(aio or {})
    if "thread_count" in cfg:  # upstream's old name
        cfg.setdefault("intra_op_parallelism", cfg.pop("thread_count"))
    if cfg.pop("use_gds", False):
        raise ValueError("aio.use_gds=true: GPUDirect Storage is not implemented; set it false")
    unknown = sorted(set(cfg) - set(_AIO_KEYS))
    if unknown:
        raise ValueError(f"aio: unknown keys {unknown}; expected some of {list(_AIO_KEYS)}")
    return cfg


def _copy_back(buf: torch.Tensor, out: torch.Tensor) -> None:
    """A read staged through `buf` reaches the tensor it was for."""
    n = out.numel() * out.element_size()
    out.detach().copy_(buf[:n].view(out.dtype).view(out.shape))


class _Reads:
    """The reads issued on one handle: completed all together (wait_reads) or one key at a
    time (wait_read), so that a read-ahead several shards deep hands out its first shard as
    soon as that one is read, not when the last one is."""

    def __init__(self, handle: AioHandle) -> None:
        self.handle = handle
        self.ops: dict[str, int] = {}  # key -> the id of its read not yet waited for
        self.copy_back: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key: (staging, out)


@dataclass(frozen=True)
class _Entry:
    path: str
    numel: int
    dtype: torch.dtype
    nbytes: int


class _Files:
    """What cleanup needs, without the swapper (so the exit-time finalizer keeps no cycle)."""

    def __init__(self, root: str, handles: list[AioHandle], lock: int) -> None:
        self.root = root
        self.handles = handles
        self.lock = lock

    def remove(self) -> None:
        for handle in self.handles:
            try:
                if handle.pending_ops():
                    handle.wait()  # never delete files under running I/O
            except RuntimeError:
                pass  # reported by wait() if anyone still asks; the files go regardless
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(self.root + ".lock")
        os.close(self.lock)  # after the files: no other swapper takes the directory before
        tag_dir = os.path.dirname(self.root)
        for d in (tag_dir, os.path.dirname(tag_dir)):  # other ranks' dirs may remain
            try:
                os.rmdir(d)
            except OSError:
                break


def _own_directory(tag_dir: str, rank: int) -> tuple[str, int]:
    """rank<rank>/ under tag_dir, or rank<rank>.<n>/ for the first n no live swapper holds
    ([Note: NVMe swap files]); the directory and the descriptor holding its lock."""
    n, races = 0, 0
    while n < 1024:
        d = os.path.join(tag_dir, f"rank{int(rank)}" + (f".{n}" if n else ""))
        try:
            fd = _lock_beside(d)
        except OSError as e:
            raise ValueError(f"NVMeSwapper: cannot create {d!r} ({e.strerror})") from None
        if fd is None:
            n += 1  # a live swapper's: the next one
            continue
        if fd < 0:  # its holder was releasing it as we locked: the same one again
            races += 1
            if races > 100:
                raise ValueError(f"NVMeSwapper: {d!r} kept changing under its lock; try again")
            continue
        try:
            os.makedirs(d, exist_ok=True)  # after the lock: a releasing holder removes it
        except OSError as e:
            os.close(fd)
            raise ValueError(f"NVMeSwapper: cannot create {d!r} ({e.strerror})") from None
        return d, fd
    raise ValueError(f"NVMeSwapper: 1024 live swappers hold the directories of {tag_dir!r}")


def _lock_beside(d: str) -> int | None:
    """An exclusive lock on d.lock (beside d: the keys stay alone in d): its descriptor;
    None if a live swapper holds it; -1 if the file we locked is no longer d.lock (its
    holder unlinked it while releasing, between our open and our lock: holding that file
    would own nothing, and the next swapper would take d too; or removed the folder it is
    in between our makedirs and our open)."""
    os.makedirs(os.path.dirname(d), exist_ok=True)
    try:
        fd = os.open(d + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        now = os.stat(d + ".lock")
    except FileNotFoundError:
        now = None
    mine = os.fstat(fd)
    if now is None or (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev):
        os.close(fd)
        return -1
    return fd


class NVMeSwapper:
    """Swaps CPU (or device) tensors to files and back; see [Note: NVMe swap files]."""

    def __init__(
        self, nvme_path: str, rank: int, tag: str, aio: Mapping[str, Any] | None = None
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag) or tag in (".", ".."):
            raise ValueError(f"NVMeSwapper: tag {tag!r} must be a plain file name")
        self._dir, lock = _own_directory(os.path.join(nvme_path, "zero_stage_3", tag), rank)
        for name in os.listdir(self._dir):  # left by a crashed run of the same tag and rank
            if name.endswith(".swp"):
                os.unlink(os.path.join(self._dir, name))
        # Reads and writes on handles of their own, so each kind can be waited for alone
        # ([Note: pipelined optimizer swap]). Background reads (optimizer state read during
        # the backward: [Note: optimizer steps in backward]) have a third, so that waiting
        # for a parameter shard does not wait for them too.
        # The third is made at the first background read: most swappers never make one.
        self._aio = _aio_kwargs(aio)
        self._handle = aio_handle(**self._aio)
        self._whandle = aio_handle(**self._aio)
        self._handles = [self._handle, self._whandle]  # cleanup waits for each
        self._reads = _Reads(self._handle)
        self._bg: _Reads | None = None
        self._entries: dict[str, _Entry] = {}
        self._writing: set[str] = set()  # keys with a write not yet waited for
        self._staged: list[torch.Tensor] = []  # staging buffers of in-flight writes
        self._pool: list[torch.Tensor] = []  # free page-aligned uint8 staging buffers
        self._cleanup = weakref.finalize(self, _Files(self._dir, self._handles, lock).remove)

    @property
    def directory(self) -> str:
        return self._dir

    def swap_out(self, key: str, tensor: torch.Tensor, async_op: bool = False) -> None:
        """Writes the tensor's bytes to the file of `key` (replacing what it held)."""
        self._check_open()
        self.wait_read(key)
        if key in self._writing:
            self.wait_writes()
        src = tensor.detach()
        nbytes = src.numel() * src.element_size()
        if src.device.type != "cpu" or not src.is_contiguous():
            buf = self._take(nbytes)
            buf[:nbytes].view(src.dtype).view(src.shape).copy_(src)
            self._staged.append(buf)
            src = buf[:nbytes]
        old = self._entries.get(key)
        path = old.path if old else self._new_path(key)
        if old is not None and old.nbytes > nbytes:
            os.truncate(path, nbytes)  # a write keeps the bytes past its end
        self._entries[key] = _Entry(path, tensor.numel(), tensor.dtype, nbytes)
        self._writing.add(key)
        self._whandle.async_pwrite(src, path)
        if not async_op:
            self.wait_writes()

    def swap_in(
        self, key: str, out: torch.Tensor, async_op: bool = False, background: bool = False
    ) -> None:
        """Reads the bytes of `key` into `out` (same numel and dtype as swapped out).
        background: on the background handle, completed by wait_reads(background=True)."""
        self._check_open()
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"NVMeSwapper: nothing was swapped out under key {key!r}")
        if out.numel() != entry.numel or out.dtype != entry.dtype:
            raise ValueError(
                f"NVMeSwapper.swap_in({key!r}): out has {out.numel()} elements of {out.dtype}, "
                f"but {entry.numel} elements of {entry.dtype} were swapped out"
            )
        if key in self._writing:  # the file must hold what is being written first
            self.wait_writes()
        self.wait_read(key)
        lane = self._background() if background else self._reads
        dst, buf = out.detach(), None
        if dst.device.type != "cpu" or not dst.is_contiguous():
            buf = self._take(entry.nbytes)
            dst = buf[: entry.nbytes]
        try:
            lane.ops[key] = lane.handle.submit_pread(dst, entry.path)
        except BaseException:  # never queued: nothing to copy back
            if buf is not None:
                self._give(buf)
            raise
        if buf is not None:
            lane.copy_back[key] = (buf, out)
        if not async_op:
            self._wait_read(lane, key)

    def wait(self) -> None:
        """Completes every async op; raises the first error (naming the file and errno)."""
        try:
            self.wait_reads()
            self.wait_reads(background=True)
        finally:
            self.wait_writes()

    def wait_reads(self, background: bool = False) -> None:
        """Completes the async reads (their data is then in the tensors given): those
        issued with swap_in(background=background)."""
        self._wait_reads(self._bg if background else self._reads)

    def _background(self) -> _Reads:
        if self._bg is None:
            handle = aio_handle(**self._aio)
            self._handles.append(handle)
            self._bg = _Reads(handle)
        return self._bg

    def wait_read(self, key: str) -> None:
        """Completes the async read of `key` alone (if one is in flight): reads issued
        after it may still be running."""
        for lane in (self._reads, self._bg):
            if lane is not None and key in lane.ops:
                self._wait_read(lane, key)

    def _wait_read(self, lane: _Reads, key: str) -> None:
        op = lane.ops.pop(key)
        staged = lane.copy_back.pop(key, None)
        try:
            lane.handle.wait_op(op)
            if staged is not None:
                _copy_back(*staged)
        finally:
            if staged is not None:
                self._give(staged[0])

    def _wait_reads(self, lane: _Reads | None) -> None:
        if lane is None or not lane.ops:
            return
        copy_back, lane.copy_back = lane.copy_back, {}
        lane.ops.clear()
        try:
            lane.handle.wait()
            for staged in copy_back.values():
                _copy_back(*staged)
        finally:
            for buf, _ in copy_back.values():
                self._give(buf)

    def wait_writes(self) -> None:
        """Completes the async writes (the tensors written may then change or go)."""
        if not self._writing:
            return
        staged, self._staged = self._staged, []
        self._writing.clear()
        try:
            self._whandle.wait()
        finally:
            for buf in staged:
                self._give(buf)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor for swap_in to read into without a bounce copy: page-aligned (huge-page
        aligned from 2 MiB, as the op measured faster), pinned where CUDA is. Hand it to
        release() when done."""
        return self._handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=dtype))

    def release(self, tensor: torch.Tensor) -> None:
        """A tensor from empty(): its memory goes with its last reference."""
        if tensor.numel():
            self._handle.free_cpu_locked_tensor(tensor)

    def discard(self, key: str) -> None:
        """Forgets `key` and removes its file (after its I/O)."""
        self.wait_read(key)
        if key in self._writing:
            self.wait_writes()
        entry = self._entries.pop(key, None)
        if entry is not None:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass

    def nbytes_on_disk(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def close(self) -> None:
        """Waits for in-flight ops, then removes the files. Idempotent; runs at exit too."""
        if not self._cleanup.alive:
            return
        try:
            self.wait()
        finally:
            self._cleanup()
            self._entries.clear()
            self._pool.clear()

    # -- internals -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if not self._cleanup.alive:
            raise RuntimeError(f"NVMeSwapper for {self._dir!r} is closed")

    def _new_path(self, key: str) -> str:
        # The index keeps keys apart that sanitize to the same name.
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]
        return os.path.join(self._dir, f"{len(self._entries)}.{safe}.swp")

    def _take(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self._pool if b.numel() >= nbytes]
        if fits:
            best = min(fits, key=lambda b: b.numel())
            self._pool.remove(best)
            return best
        align = self._handle.get_alignment()
        size = max(align, -(-nbytes // align) * align)
        return self._handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))

    def _give(self, buf: torch.Tensor) -> None:
        self._pool.append(buf)
        if len(self._pool) > _POOL_MAX:  # keep the small ones: the big are the rare ones
            self._pool.sort(key=lambda b: b.numel())
            self._handle.free_cpu_locked_tensor(self._pool.pop())
