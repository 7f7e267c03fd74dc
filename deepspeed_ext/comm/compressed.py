"""1-bit all-reduce with error feedback (the 1-bit Adam paper's compressed all-reduce).

[Note: compressed all-reduce]
A mean over the group's w ranks of a tensor of n elements, moving signs instead of values.
The tensor is padded to N (a multiple of 8 w) and cut into w chunks of c = N / w.
1. Worker: each chunk of y = x + worker_error is compressed to c / 8 bytes of signs and one
   scale (the chunk's root mean square); worker_error keeps what that lost.
2. all_to_all: rank r receives every worker's chunk r (bytes and scales).
3. Server: rank r averages them (the sum of scale_j * sign_j over j, over w), adds its
   server_error for chunk r, compresses that again, and keeps the new loss in server_error.
4. all_gather: every rank receives every server's compressed chunk and decodes the mean.
Each rank sends (w - 1) / w of N / 8 bytes in step 2 and N / (8 w) bytes to each of the others
in step 4, so 2 (w - 1) / w x N / 8 bytes in all, against 2 (w - 1) / w x 4 N for a ring
all-reduce of fp32 values: 1/32 of it (1/16 of fp16), plus 2 w scales. Several tensors go
through the same four collectives (means_with_), each chunk of each tensor with its own
scale, so a small tensor's signs are not scaled by a large one's magnitude. Both error buffers carry
the loss into the next call, so the running sum of the results tracks the running sum of the
true means (what momentum SGD and 1-bit Adam need). The codec (the packbits op) is handed in by
the layer above: comm moves tensors, it does not pick kernels.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .checked import dist
from .layout import resolve


class SignCodec(Protocol):
    def compress(
        self, x: torch.Tensor, error: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (uint8 bits, float32 [1] scale)

    def decompress(
        self,
        bits: torch.Tensor,
        scale: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        accumulate: bool,
    ) -> torch.Tensor: ...


@dataclass
class _Errors:
    worker: torch.Tensor  # [N] float32: what this rank's compressions lost
    server: torch.Tensor  # [c] float32: what this rank's server-side compressions lost


class CompressedAllReduce:
    """Error-compensated 1-bit mean over a group, one pair of error buffers per key."""

    def __init__(self, codec: SignCodec, group: Any = None) -> None:
        self.codec = codec
        self.group = group
        self.pg, self.world = resolve(group)
        self.errors: dict[Hashable, _Errors] = {}
        # bytes this rank put on the wire, and what an fp32 all-reduce of the same tensors
        # would have (both as nccl-tests' bus bytes), since take_window()
        self._sent = 0.0
        self._fp32 = 0.0

    def take_window(self) -> dict[str, float]:
        """`wire_mb` sent and `compression_x` against an fp32 all-reduce, since the last call
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
        """Replace x by (an error-compensated 1-bit estimate of) its mean over the group,
        with this object keeping the error buffers under `key`."""
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
        """mean_() of several tensors in the same four collectives, with the caller's error
        buffers (worker [padded(n)], server [padded(n) / world], float32, on the tensors'
        device), each tensor's chunks keeping scales of their own."""
        if self.world == 1 or not xs:
            return
        w, dev = self.world, xs[0].device
        sizes = [x.numel() for x in xs]
        chunks = [self.padded(n) // w for n in sizes]  # per tensor: c_k, a multiple of 8
        for x, we, se, c in zip(xs, worker_errors, server_errors, chunks):
            if we.numel() != c * w or se.numel() != c:
                raise ValueError(
                    f"error buffers of {we.numel()} and {se.numel()} elements for a tensor of "
                    f"{x.numel()}: expected {c * w} and {c}"
                )
        row = sum(chunks) // 8  # bytes of one rank's share: chunk r of every tensor
        k = len(xs)
        ys = []
        for x, c in zip(xs, chunks):
            if x.dtype == torch.float32 and x.is_contiguous() and x.numel() == c * w:
                ys.append(x.view(-1))  # no padding needed: work in place
                continue
            y = torch.zeros(c * w, dtype=torch.float32, device=dev)
            y[: x.numel()].copy_(x.reshape(-1))
            ys.append(y)
        # 1. worker compression: chunk j of tensor t, one scale each, laid out by rank j
        send_bits = torch.empty(w, row, dtype=torch.uint8, device=dev)
        send_scales = torch.empty(w, k, dtype=torch.float32, device=dev)
        for j in range(w):
            at = 0
            for t, (y, we, c) in enumerate(zip(ys, worker_errors, chunks)):
                bits, scale = self.codec.compress(y[j * c : (j + 1) * c], we[j * c : (j + 1) * c])
                send_bits[j, at : at + c // 8].copy_(bits)
                send_scales[j, t : t + 1].copy_(scale)
                at += c // 8
        # 2. share r of every worker to rank r
        recv_bits = torch.empty_like(send_bits)
        recv_scales = torch.empty_like(send_scales)
        dist.all_to_all_single(recv_bits, send_bits, group=self.pg)
        dist.all_to_all_single(recv_scales, send_scales, group=self.pg)
        # 3. server: each tensor's chunk averaged over the workers, compressed again
        server_bits = torch.empty(row, dtype=torch.uint8, device=dev)
        server_scales = torch.empty(k, dtype=torch.float32, device=dev)
        at = 0
        for t, (se, c) in enumerate(zip(server_errors, chunks)):
            mean = torch.zeros(c, dtype=torch.float32, device=dev)
            for j in range(w):
                part = recv_bits[j, at : at + c // 8]
                self.codec.decompress(part, recv_scales[j, t : t + 1] / w, c, mean, True)
            bits, scale = self.codec.compress(mean, se)
            server_bits[at : at + c // 8].copy_(bits)
            server_scales[t : t + 1].copy_(scale)
            at += c // 8
        # 4. every server's share to every rank, decoded into each tensor
        all_bits = torch.empty(w, row, dtype=torch.uint8, device=dev)
        all_scales = torch.empty(w, k, dtype=torch.float32, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(all_bits, server_bits.reshape(1, -1), group=self.pg)
        gather(all_scales, server_scales.reshape(1, -1), group=self.pg)
        for j in range(w):
            at = 0
            for t, (y, c) in enumerate(zip(ys, chunks)):
                part = all_bits[j, at : at + c // 8]
                self.codec.decompress(
                    part, all_scales[j, t : t + 1], c, y[j * c : (j + 1) * c], False
                )
                at += c // 8
        share = (w - 1) / w  # what a rank sends of an all-to-all's or all-gather's buffer
        self._sent += share * 2 * (w * row + w * k * 4)  # signs and scales, both phases
        self._fp32 += share * 2 * 4 * sum(sizes)
        for x, y in zip(xs, ys):
            if y.data_ptr() != x.data_ptr():
                x.copy_(y[: x.numel()].view_as(x))
