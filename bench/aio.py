"""Benchmark: sequential write and read GB/s of the async_io op against dd with O_DIRECT.

Workload: one file of --mib MiB (default 1024) on one file system, moved in --block-kib
pieces (default 1024, dd's bs too). Contenders, alternating in rounds (order reversed every
other round), median wall time over the rounds:
  ours          aio_handle(block_size, queue_depth).sync_pwrite / sync_pread of a page-aligned
                tensor (new_cpu_locked_tensor), random bytes; the default backend: io_uring
                where the kernel offers it (results say which: backend, backend_reason)
  ours bounce   the same from an ordinary torch tensor (memory off the page: bounce copies)
  ours qd=1     ours with queue_depth=1 (one request in flight, as dd has)
  ours threads  ours on the pread/pwrite thread pool (DS_AIO_IO_URING=0)
  ours threads bounce   the thread pool from the ordinary tensor
  dd            dd bs=<block> oflag=direct (from /dev/zero) / iflag=direct (to /dev/null)
Every write goes to a fresh file; reads are O_DIRECT on both sides, so the page cache
serves neither. Target (issue): ours >= 90% of dd's GB/s, for read and for write.

    python bench/aio.py            # full run, writes bench/results/aio.json
    python bench/aio.py --smoke    # 16 MiB, writes bench/results/aio_smoke.json

The file lives under --dir (default $DS_AIO_BENCH_DIR or ~/.cache/deepspeed_ext/aio_bench):
point it at the NVMe drive to measure. The run shrinks the file to fit the free space.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import busy_warning, machine_info, median, print_table, write_result

OURS, BOUNCE, QD1, DD = "ours", "ours bounce", "ours qd=1", "dd"
THREADS, THREADS_BOUNCE = "ours threads", "ours threads bounce"
NAMES = [OURS, BOUNCE, QD1, THREADS, THREADS_BOUNCE, DD]
TARGET = 0.9  # ours GB/s / dd GB/s, read and write (issue)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="16 MiB file, for the test suite")
    ap.add_argument("--mib", type=int, default=1024, help="file size in MiB")
    ap.add_argument("--block-kib", type=int, default=1024, help="block size (ours and dd's bs)")
    ap.add_argument("--queue-depth", type=int, default=8, help="aio_handle queue_depth")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    default_dir = os.environ.get("DS_AIO_BENCH_DIR") or str(
        Path.home() / ".cache" / "deepspeed_ext" / "aio_bench"
    )
    ap.add_argument("--dir", default=default_dir, help="directory on the file system to test")
    args = ap.parse_args()
    if args.smoke:
        args.mib = 16
    if min(args.mib, args.block_kib, args.queue_depth, args.rounds) < 1:
        ap.error("--mib, --block-kib, --queue-depth and --rounds must be >= 1")
    return args


def mount_of(path: str) -> dict[str, str]:
    """Mount point, device and type of the file system holding `path`."""
    best = {"mount": "", "device": "?", "fs": "?"}
    real = os.path.realpath(path)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        dev, mnt, fs = line.split()[:3]
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) > len(best["mount"]):
            best = {"mount": mnt, "device": dev, "fs": fs}
    return best


def fit_size(args: argparse.Namespace, directory: str) -> tuple[int, str | None]:
    """File size in bytes (a whole number of blocks), shrunk to half the free space."""
    block = args.block_kib * 1024
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    want = args.mib * 2**20
    size = max(block, min(want, free // 2) // block * block)
    note = None
    if size < want:
        note = f"shrunk to {size / 2**20:.0f} MiB: {free / 2**30:.1f} GiB free in {directory}"
    return size, note


class DirectDD:
    """dd with O_DIRECT, timed by wall clock like ours; records why when it cannot run."""

    def __init__(self, path: str, size: int, block: int) -> None:
        self.path, self.count, self.bs = path, size // block, block
        self.skipped: str | None = None if shutil.which("dd") else "dd not found"

    def _run(self, argv: list[str]) -> float | None:
        if self.skipped:
            return None
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            self.skipped = f"{' '.join(argv)}: {r.stderr.strip()[-300:]}"
            return None
        return dt

    def write(self) -> float | None:
        Path(self.path).unlink(missing_ok=True)
        of = f"of={self.path}"
        return self._run(
            ["dd", "if=/dev/zero", of, f"bs={self.bs}", f"count={self.count}", "oflag=direct"]
        )

    def read(self) -> float | None:
        return self._run(["dd", f"if={self.path}", "of=/dev/null", f"bs={self.bs}", "iflag=direct"])


def thread_pool_handle(block: int, queue_depth: int) -> Any:
    """A handle on the pread/pwrite thread pool (DS_AIO_IO_URING=0 while it is made)."""
    from deepspeed_ext.ops.aio import aio_handle

    saved = os.environ.get("DS_AIO_IO_URING")
    os.environ["DS_AIO_IO_URING"] = "0"
    try:
        return aio_handle(block_size=block, queue_depth=queue_depth)
    finally:
        if saved is None:
            del os.environ["DS_AIO_IO_URING"]
        else:
            os.environ["DS_AIO_IO_URING"] = saved


def run(args: argparse.Namespace, directory: str, size: int) -> dict[str, Any]:
    from deepspeed_ext.ops.aio import aio_handle

    block = args.block_kib * 1024
    path = os.path.join(directory, "aio_bench.bin")
    h = aio_handle(block_size=block, queue_depth=args.queue_depth)
    h1 = aio_handle(block_size=block, queue_depth=1)
    ht = thread_pool_handle(block, args.queue_depth)
    aligned = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    aligned.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    plain = aligned.clone()  # ordinary allocation: not page-aligned (checked below)
    bufs = {OURS: aligned, BOUNCE: plain, QD1: aligned, THREADS: aligned, THREADS_BOUNCE: plain}
    handles = {OURS: h, BOUNCE: h, QD1: h1, THREADS: ht, THREADS_BOUNCE: ht}
    dd = DirectDD(path, size, block)

    def ours_write(name: str) -> float:
        Path(path).unlink(missing_ok=True)
        t0 = time.perf_counter()
        handles[name].sync_pwrite(bufs[name], path)
        return time.perf_counter() - t0

    def ours_read(name: str) -> float:
        t0 = time.perf_counter()
        handles[name].sync_pread(bufs[name], path)
        return time.perf_counter() - t0

    names = NAMES
    times: dict[str, dict[str, list[float]]] = {"write": {}, "read": {}}
    for kind in times:
        times[kind] = {n: [] for n in names}
    ours_write(OURS)  # warm-up: threads, ring, allocator, file system metadata
    ours_write(THREADS)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:  # each read follows its own write: same file, same size
            if name == DD:
                tw, tr = dd.write(), dd.read()
            else:
                tw, tr = ours_write(name), ours_read(name)
            if tw is not None and tr is not None:
                times["write"][name].append(tw)
                times["read"][name].append(tr)
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr)
    back = torch.empty_like(aligned)
    h.sync_pwrite(aligned, path)
    h.sync_pread(back, path)
    exact = bool(torch.equal(back, aligned))
    Path(path).unlink(missing_ok=True)

    out: dict[str, Any] = {"raw_s": times, "median_s": {}, "gbps": {}, "ours_over_dd": {}}
    for kind, per in times.items():
        med = {n: median(t) for n, t in per.items() if t}
        out["median_s"][kind] = med
        out["gbps"][kind] = {n: size / s / 1e9 for n, s in med.items()}
        if DD in med:
            out["ours_over_dd"][kind] = {
                n: out["gbps"][kind][n] / out["gbps"][kind][DD] for n in NAMES if n != DD
            }
    out["ours_over_threads"] = {
        kind: out["gbps"][kind][OURS] / out["gbps"][kind][THREADS] for kind in times
    }
    out["dd_skipped"] = dd.skipped
    out["backend"] = h.backend()  # of ours, ours bounce, ours qd=1
    out["backend_reason"] = h.backend_reason() or None
    # None: O_DIRECT was used
    out["buffered_reason"] = h.buffered_reason() or h1.buffered_reason() or None
    out["threads"] = h.get_thread_count()
    out["threads_of_thread_pool"] = ht.get_thread_count()
    out["bounce_buffer_offset"] = plain.data_ptr() % 4096
    out["roundtrip_bit_exact"] = exact
    return out


def report(args: argparse.Namespace, res: dict[str, Any], size: int, fs: dict[str, str]) -> None:
    print(
        f"\n== {size / 2**20:.0f} MiB file, {args.block_kib} KiB blocks, queue_depth "
        f"{args.queue_depth}, ours on {res['backend']} (threads: "
        f"{res['threads_of_thread_pool']}), {fs['fs']} on {fs['device']} "
        f"({fs['mount']}), median of {args.rounds} =="
    )
    rows = []
    for name in NAMES:
        row: list[Any] = [name]
        for kind in ("write", "read"):
            g = res["gbps"][kind].get(name)
            ratio = res["ours_over_dd"].get(kind, {}).get(name)
            row += [
                "skipped" if g is None else f"{g:.2f}",
                "-" if ratio is None else f"{ratio:.0%}",
            ]
        rows.append(row)
    print_table(["contender", "write GB/s", "of dd", "read GB/s", "of dd"], rows)
    if res["dd_skipped"]:
        print(f"dd: skipped ({res['dd_skipped']})")
    if res["backend_reason"]:
        print(f"note: ours backend {res['backend']}: {res['backend_reason']}")
    if res["buffered_reason"]:
        print(f"note: ours used buffered I/O: {res['buffered_reason']}")
    print(f"round trip bit-exact: {res['roundtrip_bit_exact']}")
    vs = res["ours_over_threads"]
    print(f"ours ({res['backend']}) over threads: write {vs['write']:.0%}, read {vs['read']:.0%}")
    print("targets (issue): ours >= 90% of dd")
    for kind in ("write", "read"):
        got = res["ours_over_dd"].get(kind, {}).get(OURS)
        verdict = "n/a" if got is None else ("met" if got >= TARGET else "NOT met")
        shown = "-" if got is None else f"{got:.0%}"
        print(f"  {kind:<5}  >= {TARGET:.0%}   got {shown:>5}  {verdict}")


def main() -> int:
    args = parse_args()
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    os.makedirs(args.dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="run_", dir=args.dir)
    t0 = time.perf_counter()
    try:
        size, size_note = fit_size(args, directory)
        if size_note:
            print(f"note: {size_note}", file=sys.stderr)
        fs = mount_of(directory)
        res = run(args, directory, size)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(args, res, size, fs)
    wall = time.perf_counter() - t0
    payload = {
        "benchmark": "aio",
        "workload": {
            "bytes": size,
            "block_bytes": args.block_kib * 1024,
            "queue_depth": args.queue_depth,
            "rounds": args.rounds,
            "smoke": args.smoke,
            "size_note": size_note,
        },
        "file_system": {**fs, "dir": args.dir},
        "machine": machine_info("cpu"),
        "targets": {"ours_over_dd": TARGET},
        # Upstream's async_io op builds against libaio-dev; the peer is dd.
        "upstream_peer": "not run: upstream's async_io needs libaio (not required here)",
        "results": res,
        "busy_warning": warning,
        "wall_s": wall,
    }
    path = write_result("aio", payload, smoke=args.smoke)
    if warning:
        print(warning)
    print(f"\nwrote {path} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
