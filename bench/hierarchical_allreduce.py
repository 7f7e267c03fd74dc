"""Flat against hierarchical all-reduce ([Note: hierarchical all-reduce]) and ZeRO's
reduce-scatter ([Note: hierarchical reduce-scatter]), 2 "nodes" x 2 ranks: each node a
network namespace, the two joined by a veth pair with a tc rate limit (made here and removed
after; needs root), the ranks of a node talking over its own addresses (not rate-limited).
Times the sum of one 25 MB fp32 bucket (and its reduce-scatter to the ranks' chunks, as
ZeRO runs it), median of the timed calls, every way in one run.

    python bench/hierarchical_allreduce.py                 # 1 Gbit/s between the nodes
    python bench/hierarchical_allreduce.py --rate 500mbit
    python bench/hierarchical_allreduce.py --smoke         # loopback only, small (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402
from common import busy_warning, machine_info, median, print_table, write_result  # noqa: E402

from deepspeed_ext.comm.exchange import beats_ring  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch

    from deepspeed_ext import comm
    from deepspeed_ext.comm.hierarchical import HierarchicalWork
    from deepspeed_ext.comm.layout import axis_of

    torch.set_num_threads(1)
    comm.init_distributed()
    rank = comm.get_rank()
    groups, why = comm.node_groups(axis_of(None), int(args.per_node))
    if groups is None:
        raise SystemExit(f"no node groups: {why}")
    n = args.mb * 2**20 // 4
    # on the collectives' device (gloo: the host), as the runtime's buckets are
    x = torch.randn(
        n, generator=torch.Generator().manual_seed(rank), device=comm.collective_device()
    )
    hows = ("flat", "hierarchical", "rs_flat", "rs_hierarchical")
    times: dict[str, list[float]] = {how: [] for how in hows}
    world = comm.get_world_size()
    for i in range(args.warmup + args.iters):
        for how in hows:  # alternating, so drift hits every way
            buf = x.clone()
            own = buf[rank * (n // world) : (rank + 1) * (n // world)]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if how == "flat":
                torch.distributed.all_reduce(buf)
            elif how == "hierarchical":
                HierarchicalWork(buf, groups, args.segments).wait()
            elif how == "rs_flat":  # what ZeRO 1-3 run with the flat topology
                comm.reduce_scatter_bucket(own, buf, group=axis_of(None)).wait()
            else:
                comm.reduce_scatter_bucket_hierarchical(own, buf, groups).wait()
            torch.distributed.barrier()
            if i >= args.warmup:
                times[how].append(time.perf_counter() - t0)
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))


def run(args: argparse.Namespace, link: netns.Link | None) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
        argv += ["--mb", str(args.mb), "--iters", str(args.iters)]
        argv += ["--warmup", str(args.warmup), "--per-node", str(args.per_node)]
        argv += ["--segments", str(args.segments)]
        procs = netns.start_ranks(link, args.per_node, argv, 29900 + os.getpid() % 90)
        netns.wait_ranks(procs, timeout=600)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--mb", type=int, default=25, help="bucket size in MB (fp32)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--per-node", default="2,4", help="ranks per node; a list runs each")
    ap.add_argument("--segments", type=int, default=0, help="0: the runtime's choice")
    ap.add_argument("--rate", default="1gbit", help="the inter-node link's tc rate")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.mb, args.iters, args.per_node = 1, 2, "2"
    warn = busy_warning()
    if warn:
        print(warn)
    why_not = None if args.smoke else netns.available()
    if why_not:
        print(f"rate-limited link unavailable ({why_not}): loopback only")
    results, rows = [], []
    for per in (int(p) for p in str(args.per_node).split(",")):
        args.per_node = per
        if args.smoke or why_not:
            times, where = run(args, None), "loopback"
        else:
            with netns.linked_pair("ha", rate=args.rate) as link:
                times, where = run(args, link), f"veth {args.rate}"
        med = {how: median(ts) for how, ts in times.items()}
        flat, hier = med["flat"], med["hierarchical"]
        # the bytes each node sends across: 2 (2L - 1) / 2L x S flat, S hierarchical
        bound = 2 * (2 * per - 1) / (2 * per)
        # ZeRO's flat reduce-scatter on gloo: pairwise exchanges, a node sending L (W - L) / W
        # x S across, or the ring all-reduce where that is more ([Note: reduce-scatter by
        # exchange]); two steps: (W - L) / W x S across ([Note: hierarchical reduce-scatter])
        w = 2 * per
        exchange = beats_ring(tuple(range(w)), per)
        flat_rs = per * (w - per) / w if exchange else 2 * (w - 1) / w
        rs_bound = flat_rs / ((w - per) / w)
        for what, a, b, bnd in (
            ("all-reduce", flat, hier, bound),
            ("reduce-scatter", med["rs_flat"], med["rs_hierarchical"], rs_bound),
        ):
            rows.append([f"2 x {per}", what, f"{a * 1e3:.1f}", f"{b * 1e3:.1f}"])
            rows[-1] += [f"{a / b:.2f}x", f"{bnd:.2f}x"]
        results.append(
            {
                "ranks_per_node": per,
                "link": where,
                "median_s": med,
                "speedup": flat / hier,
                "byte_ratio_bound": bound,
                "reduce_scatter_speedup": med["rs_flat"] / med["rs_hierarchical"],
                "reduce_scatter_byte_ratio_bound": rs_bound,
                "raw": times,
            }
        )
    headers = ["nodes x ranks", "collective", "flat ms", "hierarchical ms", "speed-up"]
    print_table(headers + ["bytes bound"], rows)
    path = write_result(
        "hierarchical_allreduce",
        {
            "workload": {
                "nodes": 2,
                "bucket_mb": args.mb,
                "dtype": "fp32",
                "timed_calls": args.iters,
                "segments": args.segments or "the runtime's choice",
                "why_no_limited_link": why_not,
            },
            "machine": machine_info(),
            "busy_warning": warn,
            "results": results,
        },
        smoke=args.smoke,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
