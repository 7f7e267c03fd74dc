"""Rank bodies for test_compressed.py."""

from __future__ import annotations

from typing import Any

import torch


def repeated_means(
    steps: int, n: int, algorithm: str = "1bit", huffman: bool = False
) -> dict[str, Any]:
    from deepspeed_ext import comm
    from deepspeed_ext.comm.compressed import CompressedAllReduce
    from deepspeed_ext.runtime.compression import HuffmanRows, codec_for

    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    dev = comm.collective_device(None)
    car = CompressedAllReduce(codec_for(algorithm, 0.1), rows=HuffmanRows() if huffman else None)
    comm.configure(enabled=True, prof_all=True)
    results, truths = [], []
    for t in range(steps):
        gens = [torch.Generator().manual_seed(1000 * t + r) for r in range(world)]
        xs = [torch.randn(n, generator=g) * (1 + r) + 0.3 for r, g in enumerate(gens)]
        truths.append(torch.stack(xs).mean(0))
        x = xs[rank].clone().to(dev)
        car.mean_(x, key="p")
        results.append(x.cpu())
    rows = comm.comms_logger.summary_rows()
    comm.configure(enabled=False)
    comm.comms_logger.reset_data()
    st = car.errors["p"]
    return {
        "results": torch.stack(results),
        "truths": torch.stack(truths),
        "worker_error": st.worker.cpu(),
        "server_error": st.server.cpu(),
        "padded": car.padded(n),
        "rows": rows,
        "window": car.take_window(),
    }


def repeated_reduce_scatters(steps: int, n: int, algorithm: str) -> dict[str, Any]:
    """ZeRO's compressed reduce-scatter: each rank's chunk of the mean, over many calls."""
    from deepspeed_ext import comm
    from deepspeed_ext.comm.compressed import CompressedAllReduce
    from deepspeed_ext.runtime.compression import codec_for

    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    dev = comm.collective_device(None)
    car = CompressedAllReduce(codec_for(algorithm, 0.1))
    error = torch.zeros(n, device=dev)
    results, truths = [], []
    for t in range(steps):
        xs = [
            torch.randn(n, generator=torch.Generator().manual_seed(1000 * t + r)) * (1 + r)
            for r in range(world)
        ]
        c = n // world
        truths.append(torch.stack(xs).mean(0)[rank * c : (rank + 1) * c])
        x = xs[rank].clone().to(dev)
        car.reduce_scatter_mean_(x, error, x[rank * c : (rank + 1) * c])  # in place, as ZeRO
        results.append(x[rank * c : (rank + 1) * c].cpu())
    return {"results": torch.stack(results), "truths": torch.stack(truths), "error": error.cpu()}
