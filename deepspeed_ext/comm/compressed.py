"""Compressed mean and reduce-scatter with error feedback (the 1-bit Adam paper's compressed
all-reduce, with the compression handed in).

[Note: compressed all-reduce]
A mean over the group's w ranks of a tensor of n elements, moving compressed chunks instead
of values. The tensor is padded to N (a multiple of 8 w) and cut into w chunks of c = N / w.
1. Worker: each chunk of y = x + worker_error is encoded by the codec into a payload of
   codec.wire_bytes(c) bytes; worker_error keeps what that lost (y minus what decodes).
2. all_to_all: rank r receives every worker's chunk r.
3. Server: rank r decodes and averages them, adds its server_error for chunk r, encodes that
   again, and keeps the new loss in server_error.
4. all_gather: every rank receives every server's encoded chunk and decodes the mean.
With the 1-bit codec (signs packed 8 per byte, a scale per chunk) each rank sends
2 (w - 1) / w x N / 8 bytes plus the scales, against 2 (w - 1) / w x 4 N for a ring
all-reduce of fp32 values: 1/32 of it (1/16 of fp16). Several tensors go through the same two
collectives (means_with_), each chunk of each tensor with its own payload (so a small tensor's
signs are not scaled by a large one's magnitude). Both error buffers carry the loss into the
next call, so the running sum of the results tracks the running sum of the true means (what
momentum SGD and 1-bit Adam need).

reduce_scatter_mean_ is steps 1-3 without the server's compression: rank r keeps the decoded
mean of chunk r in full precision (ZeRO 1/2's gradient partitions), so only the worker error
exists. A lossless row coder (Huffman) may wrap each rank's row of payloads; rows then differ
in length, and their lengths travel first. Codecs and row coders are handed in by the layer
above: comm moves bytes, it does not pick kernels.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .checked import all_gather_into, dist
from .layout import AxisGroup, resolve


class ChunkCodec(Protocol):
    def wire_bytes(self, c: int) -> int:
        """Payload bytes of a chunk of c values (a multiple of 4: payloads stay aligned)."""
        ...

    def encode(self, x: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        """y = x + error (x [c], error [c] float32) into out (uint8 [wire_bytes(c)]);
        error := y - what out decodes to."""
        ...

    def decode(
        self, payload: torch.Tensor, c: int, out: torch.Tensor, weight: float, accumulate: bool
    ) -> None:
        """out (float32 [c]) = (accumulate ? out : 0) + weight * the decoded payload."""
        ...


class RowCoder(Protocol):  # lossless, variable length
    def encode(self, row: torch.Tensor) -> torch.Tensor: ...
    def decode(self, stream: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Errors:
    worker: torch.Tensor  # [N] float32: what this rank's compressions lost
    server: torch.Tensor  # [c] float32: what this rank's server-side compressions lost


class CompressedAllReduce:
    """Error-compensated compressed mean over a group, one pair of error buffers per key."""

    def __init__(self, codec: ChunkCodec, group: Any = None, rows: RowCoder | None = None) -> None:
        self.codec = codec
        self.rows = rows
        self.group = group
        self.pg, self.world = resolve(group)
        self.rank = _rank_in(group, self.pg, self.world)
        self.errors: dict[Hashable, _Errors] = {}
        # bytes this rank put on the wire, and what an fp32 all-reduce (or reduce-scatter)
        # of the same tensors would have (both as nccl-tests' bus bytes), since take_window()
        self._sent = 0.0
        self._fp32 = 0.0

    def take_window(self) -> dict[str, float]:
        """`wire_mb` sent and `compression_x` against fp32 collectives, since the last call
        (the metrics line's columns)."""
        if not self._sent:
            return {}
        out = {"wire_mb": self._sent / 2**20, "compression_x": self._fp32 / self._sent}
        self._sent = self._fp32 = 0.0
        return out

    def padded(self, n: int) -> int:
        unit = 8 * self.world
        return (n + unit - 1) // unit * unit

    def mean_(self, x: torch.Tensor, key: Hashable) -> torch.Tensor:
        """Replace x by (an error-compensated compressed estimate of) its mean over the
        group, with this object keeping the error buffers under `key`."""
        big = self.padded(x.numel())
        st = self.errors.get(key)
        if st is None or st.worker.numel() != big:
            st = self.errors[key] = _Errors(
                torch.zeros(big, dtype=torch.float32, device=x.device),
                torch.zeros(big // self.world, dtype=torch.float32, device=x.device),
            )
        self.means_with_([x], [st.worker], [st.server])
        return x

    def means_with_(
        self,
        xs: list[torch.Tensor],
        worker_errors: list[torch.Tensor],
        server_errors: list[torch.Tensor],
    ) -> None:
        """mean_() of several tensors in the same collectives, with the caller's error
        buffers (worker [padded(n)], server [padded(n) / world], float32, on the tensors'
        device), each tensor's chunks compressed on their own."""
        if self.world == 1 or not xs:
            return
        w, dev = self.world, xs[0].device
        chunks = [self.padded(x.numel()) // w for x in xs]  # per tensor: c_k, a multiple of 8
        for x, we, se, c in zip(xs, worker_errors, server_errors, chunks):
            if we.numel() != c * w or se.numel() != c:
                raise ValueError(
                    f"error buffers of {we.numel()} and {se.numel()} elements for a tensor of "
                    f"{x.numel()}: expected {c * w} and {c}"
                )
        ys = [_padded_f32(x, c * w) for x, c in zip(xs, chunks)]
        sizes = [self.codec.wire_bytes(c) for c in chunks]
        row = sum(sizes)
        # 1. worker compression: chunk j of every tensor into row j
        send = torch.zeros(w, row, dtype=torch.uint8, device=dev)  # padding bytes too
        for j in range(w):
            at = 0
            for y, we, c, size in zip(ys, worker_errors, chunks, sizes):
                part = slice(j * c, (j + 1) * c)
                self.codec.encode(y[part], we[part], send[j, at : at + size])
                at += size
        # 2. row r of every worker to rank r
        recv = self._all_to_all(send)
        # 3. server: each tensor's chunk averaged over the workers, compressed again
        server = torch.zeros(row, dtype=torch.uint8, device=dev)
        at = 0
        for se, c, size in zip(server_errors, chunks, sizes):
            mean = torch.empty(c, dtype=torch.float32, device=dev)
            for j in range(w):
                self.codec.decode(recv[j, at : at + size], c, mean, 1.0 / w, j > 0)
            self.codec.encode(mean, se, server[at : at + size])
            at += size
        # 4. every server's row to every rank, decoded into each tensor
        everyone = self._all_gather(server)
        for j in range(w):
            at = 0
            for y, c, size in zip(ys, chunks, sizes):
                self.codec.decode(everyone[j, at : at + size], c, y[j * c : (j + 1) * c], 1, False)
                at += size
        self._fp32 += 2 * (w - 1) / w * 4 * sum(x.numel() for x in xs)
        for x, y in zip(xs, ys):
            if y.data_ptr() != x.data_ptr():
                x.copy_(y[: x.numel()].view_as(x))

    def reduce_scatter_mean_(
        self, x: torch.Tensor, worker_error: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out := this rank's chunk (x's r-th of w equal parts) of the group's mean of x,
        decoded in full precision; worker_error ([x.numel()] float32) keeps what this rank's
        compression lost. out may be a view into x."""
        n, w = x.numel(), self.world
        if n % w:
            raise ValueError(f"reduce_scatter_mean_: {n} elements do not split into {w} chunks")
        if worker_error.numel() != n:
            raise ValueError(f"worker_error has {worker_error.numel()} elements, x has {n}")
        if w == 1:
            out.copy_(x.reshape(-1)[: out.numel()].view_as(out))
            return
        c = n // w
        size = self.codec.wire_bytes(c)
        flat = x.reshape(-1)
        send = torch.zeros(w, size, dtype=torch.uint8, device=x.device)
        for j in range(w):
            self.codec.encode(flat[j * c : (j + 1) * c], worker_error[j * c : (j + 1) * c], send[j])
        recv = self._all_to_all(send)
        mean = torch.empty(c, dtype=torch.float32, device=x.device)
        for j in range(w):
            self.codec.decode(recv[j], c, mean, 1.0 / w, j > 0)
        out.copy_(mean.view_as(out))
        self._fp32 += (w - 1) / w * 4 * n

    # -- moving rows: fixed length, or coded rows with their lengths first --
    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        w, row = send.shape
        if self.rows is None:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.pg)
            self._sent += (w - 1) * row
            return recv
        streams = [self.rows.encode(send[j].cpu()) for j in range(w)]
        lens = torch.tensor([s.numel() for s in streams], dtype=torch.int64)
        dev = send.device
        got = torch.empty(w, dtype=torch.int64, device=dev)
        dist.all_to_all_single(got, lens.to(dev), group=self.pg)
        got_cpu = got.cpu()
        recv_flat = torch.empty(int(got_cpu.sum()), dtype=torch.uint8, device=dev)
        dist.all_to_all_single(
            recv_flat,
            torch.cat(streams).to(dev),
            output_split_sizes=got_cpu.tolist(),
            input_split_sizes=lens.tolist(),
            group=self.pg,
        )
        self._sent += float(lens.sum() - lens[self.rank]) + 8 * (w - 1)
        parts = recv_flat.cpu().split(got_cpu.tolist())
        return torch.stack([self._decoded(p, row) for p in parts]).to(send.device)

    def _all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        w, row = self.world, mine.numel()
        gather = all_gather_into
        if self.rows is None:
            everyone = torch.empty(w, row, dtype=torch.uint8, device=mine.device)
            gather(everyone, mine.reshape(1, -1), group=self.pg)
            self._sent += (w - 1) * row
            return everyone
        stream = self.rows.encode(mine.cpu())
        dev = mine.device
        lens = torch.empty(w, 1, dtype=torch.int64, device=dev)
        gather(lens, torch.tensor([[stream.numel()]], dtype=torch.int64, device=dev), group=self.pg)
        lens_cpu = lens.reshape(-1).cpu().tolist()
        width = max(lens_cpu)
        padded = torch.zeros(1, width, dtype=torch.uint8)
        padded[0, : stream.numel()] = stream
        everyone = torch.empty(w, width, dtype=torch.uint8, device=dev)
        gather(everyone, padded.to(dev), group=self.pg)
        self._sent += (w - 1) * (width + 8)
        everyone = everyone.cpu()
        return torch.stack([self._decoded(everyone[j, : lens_cpu[j]], row) for j in range(w)]).to(
            mine.device
        )

    def _decoded(self, stream: torch.Tensor, row: int) -> torch.Tensor:
        assert self.rows is not None
        out = self.rows.decode(stream.contiguous())
        if out.numel() != row:
            raise RuntimeError(f"a coded row decoded to {out.numel()} bytes, expected {row}")
        return out


def _rank_in(group: Any, pg: Any, world: int) -> int:
    if isinstance(group, AxisGroup):
        return group.rank
    return dist.get_rank(pg) if world > 1 else 0


def _padded_f32(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.dtype == torch.float32 and x.is_contiguous() and x.numel() == n:
        return x.view(-1)  # no padding needed: work in place
    y = torch.zeros(n, dtype=torch.float32, device=x.device)
    y[: x.numel()].copy_(x.reshape(-1))
    return y
