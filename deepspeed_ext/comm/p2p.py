"""Point-to-point channels between neighbouring pipeline stages.

[Note: pipeline p2p]
A PipeChannel is one direction between two ranks (activations go down the pipe, gradients
come back up). What travels is a tuple of tensors. Their shapes, dtypes and requires_grad
flags (the "meta") are sent once; after that each transfer is ONE message, a packet: a
16-byte header then every tensor's bytes (16-byte aligned), received into a per-slot buffer
that is reused between micro-batches (the tensors handed out are views into it; the receiver
picks the slot, a pipeline engine one per micro-batch it has in flight). The
header's code is what keeps a failing pipeline from hanging:
  OK    the tensors follow, in the negotiated meta;
  META  the meta changed (dynamic shapes): the new meta and then a new packet follow;
  ABORT the sender failed: the receiver raises (and aborts onwards), instead of waiting for
        tensors that never come.
Before the first packet the receiver knows no size, so the first message (and an abort that
comes before any packet) is a 2-word hello [code, meta length]. Sends are non-blocking (the
receiver posts its receives in schedule order, so a schedule that is valid when simulated in
one process cannot deadlock); each send's buffer is kept alive until its work completes,
and a few are then reused for later packets (header and views made once); a channel of
fixed shapes makes its next packet right after a send, so that only the copy runs between
the stage's compute and its send (gloo reports a send complete only once waited for).
A receiver told how many messages are still to come (expect(n), from the engine's count of
its schedule's receives) posts the next one's receive as soon as a packet is in: a message
is then read off the wire when it comes, while the stage computes, instead of when the
schedule asks for it (a transport that waits for the receiver before sending, as gloo
does, otherwise adds a round trip to every late receive, on the 1F1B critical path). The
early receive lands in a spare buffer, which becomes the slot's buffer when the slot
receives; the slot's old buffer (dead by then: its views were valid until this receive)
becomes the next spare. Never more than one early receive per channel, and none past the
batch's last message, so no receive is left posted between batches.
A batch that fails part way leaves its unread messages (and abort words) queued on the
channels, where the next batch would take them for its own: the pipeline engine refuses
every batch after a failed one, naming the failure (a new engine gets new tags).

[Note: partitioned p2p]
Under tensor slicing, every tensor-parallel rank of a stage holds the same activations (and
input gradients): the sliced layers end in a sum over the group. A channel given that group
(`split`, upstream's pipe_partitioned / grad_partitioned) sends only this rank's 1/n of the
packet's payload to its peer, which gathers the whole over its own tensor group, so the
link between stages carries 1/n of the bytes and the fast group the rest. Each part is
preceded by the header, so an abort still reaches every receiver. Before the first packet
the senders check, over their group, that they do hold the same tensors (a heuristic:
norms and random projections, which rounding passes and a different tensor fails): a stage
whose outputs differ across its tensor ranks raises (and aborts the receivers) instead of
training on a mix of them. Before each gather the receivers agree on their messages' codes,
so that one failed sender makes every receiver of the stage raise.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import deque
from typing import Any, NamedTuple

import torch

from .checked import dist
from .collectives import ReduceOp, all_gather_object, all_reduce
from .layout import AxisGroup
from .sharded import all_gather_bucket, collective_device

_OK, _META, _ABORT = 0, 1, 2
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_ABORTS: list[tuple[Any, torch.Tensor]] = []  # abort words in flight (a few bytes each)
Meta = tuple[tuple[torch.dtype, bool, tuple[int, ...]], ...]


class PipeAborted(RuntimeError):
    """The rank at the other end of a pipeline channel failed (its own error says why)."""


def meta_of(tensors: tuple[torch.Tensor, ...]) -> Meta:
    return tuple((t.dtype, bool(t.requires_grad), tuple(t.shape)) for t in tensors)


def _encode(meta: Meta, device: torch.device) -> torch.Tensor:
    words = [len(meta)]
    for dtype, grad, shape in meta:
        words += [_CODE[dtype], int(grad), len(shape), *shape]
    return torch.tensor(words, dtype=torch.int64, device=device)


def _decode(words: list[int]) -> Meta:
    out = []
    n, i = words[0], 1
    for _ in range(n):
        code, grad, ndim = words[i : i + 3]
        shape = tuple(words[i + 3 : i + 3 + ndim])
        out.append((_DTYPES[code], bool(grad), shape))
        i += 3 + ndim
    return tuple(out)


def describe(meta: Meta) -> str:
    return ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for d, _, s in meta)


_HEAD = 16  # bytes: [code, meta length] as int64
_KEEP = 4  # sent packets kept per channel for reuse


@functools.lru_cache(maxsize=256)
def _layout(meta: Meta) -> tuple[tuple[int, ...], int]:
    """Byte offsets of each tensor in a packet, and the packet's size (every message of a
    channel asks again: computed once per meta)."""
    offsets, off = [], _HEAD
    for d, _, shape in meta:
        offsets.append(off)
        n = math.prod(shape) * d.itemsize
        off += (n + 15) // 16 * 16
    return tuple(offsets), off


def _part_size(meta: Meta, n: int) -> int:
    """Bytes of one rank's part of a payload cut in n (16-byte aligned; the last padded)."""
    payload = _layout(meta)[1] - _HEAD
    return (payload + 16 * n - 1) // (16 * n) * 16


def _views(buf: torch.Tensor, meta: Meta) -> tuple[torch.Tensor, ...]:
    offsets, _ = _layout(meta)
    out = []
    for off, (d, _, shape) in zip(offsets, meta):
        n = math.prod(shape) * d.itemsize
        out.append(buf[off : off + n].view(d).view(shape))
    return tuple(out)


class _Packet(NamedTuple):
    """An OK packet's buffer and its tensors' views, kept for reuse."""

    meta: Meta
    buf: torch.Tensor
    views: tuple[torch.Tensor, ...]


def check_stage_output(tensors: tuple[Any, ...], what: str) -> None:
    """What one stage hands the next must be tensors (the p2p messages carry only those)."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{what}: element {i} is a {type(t).__name__}; a pipeline stage must "
                "pass tensors (or a tuple of tensors) to the next stage"
            )


class PipeChannel:
    """One direction between this rank and `peer` (a global rank). `what` names the traffic
    in messages ("activations from stage 1"). Packets live on the collective device (NCCL
    sends device tensors only), so received tensors land where the stage computes."""

    def __init__(
        self,
        peer: int,
        what: str,
        dynamic: bool = False,
        tag: int = 0,
        max_pending: int = 64,
        device: torch.device | None = None,
        split: AxisGroup | None = None,
        group: Any = None,
    ) -> None:
        self.device = device if device is not None else collective_device()
        # the process group its messages go over (None: the world's). NCCL ignores tags and
        # matches a pair's messages in order, so two channels one way between the same two
        # ranks (model chunks) need a group, a communicator, each
        self.group = group
        # the tensor group whose ranks hold the same tensors ([Note: partitioned p2p])
        self.split = split if split is not None and split.size > 1 else None
        self.peer = peer
        self.tag = tag  # per engine: a message left over from a failed run never matches
        self.what = what
        self.dynamic = dynamic  # shapes may change between messages
        self.max_pending = max_pending
        self.sent_meta: Meta | None = None
        self.recv_meta: Meta | None = None
        self.reshape_next = False  # the next send may change shape (renegotiate())
        self._slots: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        # sends in flight: (work, buffer, the packet to reuse once sent, or None)
        self._pending: deque[tuple[Any, torch.Tensor, _Packet | None]] = deque()
        self._free: list[_Packet] = []  # sent OK packets of sent_meta, header written
        self.aborted = False
        self.expected = 0  # messages still to come this batch (expect())
        self.early_receives = 0  # receives posted early, in all
        self._early: tuple[Any, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] | None = None
        self._spare: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    # -- sending --
    def send(self, tensors: tuple[torch.Tensor, ...]) -> None:
        check_stage_output(tensors, self.what)
        for t in tensors:
            if t.dtype not in _CODE:
                raise TypeError(f"{self.what}: dtype {t.dtype} cannot be sent between stages")
        meta = meta_of(tensors)
        if meta != self.sent_meta:
            if (
                self.sent_meta is not None
                and not (self.dynamic or self.reshape_next)
                and _shapes(meta) != _shapes(self.sent_meta)
            ):
                self.abort()
                raise ValueError(
                    f"{self.what} changed shape mid-run: ({describe(self.sent_meta)}) became "
                    f"({describe(meta)}). Keep a stage's output shapes fixed (pad the batch), "
                    "call engine.reset_activation_shape() on every rank before a batch whose "
                    "shapes change, or pass dynamic_shape=True to PipelineModule to "
                    "renegotiate them per message"
                )
            if self.sent_meta is None and self.split is not None:
                self._check_replicated(tensors, meta)
            words = _encode(meta, self.device)
            if self.sent_meta is None:
                self._post(self._hello(_META, words.numel()))
            else:  # announced in a packet of the size the receiver expects
                self._post(self._packet(self.sent_meta, _META, words.numel()))
            self._post(words)
            self.sent_meta = meta
            self._free.clear()
        self.reshape_next = False
        if self.split is None:
            # a packet whose send completed, or one made after the last send: between the
            # stage's compute and its send (the critical path) only the copy runs
            self._reap()
            reuse = self._free.pop() if self._free else self._new_packet(meta)
            for view, t in zip(reuse.views, tensors):
                view.copy_(t.detach())
            self._post(reuse.buf, reuse)
            if not self._free and not self.dynamic:
                self._free.append(self._new_packet(meta))
        else:
            packet = self._packet(meta, _OK, 0)
            self._copy_part(packet, tensors, meta)
            self._post(packet)

    def _new_packet(self, meta: Meta) -> _Packet:
        buf = self._packet(meta, _OK, 0)
        return _Packet(meta, buf, _views(buf, meta))

    def _copy_part(
        self, packet: torch.Tensor, tensors: tuple[torch.Tensor, ...], meta: Meta
    ) -> None:
        """This rank's part of the payload, after the header."""
        assert self.split is not None
        c = _part_size(meta, self.split.size)
        lo, hi = self.split.rank * c, (self.split.rank + 1) * c  # in payload bytes
        offsets, _ = _layout(meta)
        for off, t in zip(offsets, tensors):
            a, b = off - _HEAD, off - _HEAD + t.nbytes
            if b <= lo or a >= hi:
                continue
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            s0, s1 = max(a, lo), min(b, hi)
            packet[_HEAD + s0 - lo : _HEAD + s1 - lo].copy_(src[s0 - a : s1 - a])

    def _check_replicated(self, tensors: tuple[torch.Tensor, ...], meta: Meta) -> None:
        """Every rank of the split group sends the same tensors, or all of them raise (once,
        before the first packet: a gather of fingerprints over the group). Floating tensors
        may differ by rounding (a kernel's atomic sums need not agree bit for bit), so they
        are compared by norm and random projections, not bytes."""
        assert self.split is not None
        prints = [describe(meta), *(_fingerprint(t) for t in tensors)]
        seen = all_gather_object(prints, group=self.split)
        for other, theirs in enumerate(seen[1:], 1):
            why = _disagreement(seen[0], theirs, tensors)
            if why is None:
                continue
            self.abort()
            raise ValueError(
                f"{self.what}: the tensor-parallel ranks of this stage hold different "
                f"tensors ({why}, tensor rank 0 against {other}), but "
                "pipeline.pipe_partitioned / grad_partitioned send each rank 1/"
                f"{self.split.size} of them and rebuild the whole on the next stage. Make the "
                "stage end where its tensor ranks agree (after a row-parallel layer's sum), "
                "or set pipeline.pipe_partitioned and pipeline.grad_partitioned to false"
            )

    def renegotiate(self) -> None:
        """The next send may change shape: its new meta goes first, as with dynamic shapes
        (the receiver needs no call: it takes a new meta whenever one comes)."""
        self.reshape_next = True

    def _hello(self, code: int, n: int) -> torch.Tensor:
        return torch.tensor([code, n], dtype=torch.int64, device=self.device)

    def _wire_size(self, meta: Meta) -> int:
        """Bytes of one message on the wire: the packet, or its header and one part."""
        if self.split is None:
            return _layout(meta)[1]
        return _HEAD + _part_size(meta, self.split.size)

    def _packet(self, meta: Meta, code: int, n: int) -> torch.Tensor:
        buf = torch.empty(self._wire_size(meta), dtype=torch.uint8, device=self.device)
        buf[:_HEAD].view(torch.int64).copy_(self._hello(code, n))
        return buf

    def _post(self, t: torch.Tensor, reuse: _Packet | None = None) -> None:
        work = dist.isend(t, self.peer, group=self.group, tag=self.tag)
        self._pending.append((work, t, reuse))
        self._reap()
        while len(self._pending) > self.max_pending:  # bound the memory of a fast sender
            self._pending[0][0].wait()
            self._sent()

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._sent()  # its buffer may go

    def _sent(self) -> None:
        _, _, reuse = self._pending.popleft()
        # a few kept (gloo reports a send complete only once waited for, at the batch's end:
        # keeping all would hold a batch of packets between batches)
        if reuse is not None and reuse.meta == self.sent_meta and len(self._free) < _KEEP:
            self._free.append(reuse)

    def wait_sends(self) -> None:
        while self._pending:
            self._pending[0][0].wait()
            self._sent()

    def abort(self) -> None:
        """Tell the peer this side failed (once; never blocks)."""
        if self.aborted:
            return
        self.aborted = True
        if self.sent_meta is None:
            word = self._hello(_ABORT, 0)
        else:
            word = self._packet(self.sent_meta, _ABORT, 0)
        try:
            work = dist.isend(word, self.peer, group=self.group, tag=self.tag)
        except Exception:  # noqa: BLE001 - the peer may be gone already
            return
        # the send reads `word` after this returns: keep it alive past this channel's life
        _ABORTS.append((work, word))

    # -- receiving --
    def expect(self, n: int) -> None:
        """n more messages come this batch: each receive but the last posts the next one's
        early ([Note: pipeline p2p])."""
        self.expected = n

    def recv(self, slot: int = 0) -> tuple[torch.Tensor, ...]:
        """The next message's tensors: views into this slot's reused buffer (valid until the
        same slot receives again)."""
        self.expected = max(self.expected - 1, 0)
        if self.recv_meta is None:  # the hello: [code, meta length]
            head = torch.empty(2, dtype=torch.int64, device=self.device)
            dist.recv(head, self.peer, group=self.group, tag=self.tag)
            code, n = head.tolist()
            self._agree(code)
        else:
            buf, views = self._landed(slot)
            wire = self._wire(buf)
            code, n = wire[:_HEAD].view(torch.int64).tolist()  # one host read per message
            self._agree(code)
            if code == _OK:
                out = self._gathered(buf, wire, views)
                self._post_early()
                return out
        if code == _ABORT:
            raise PipeAborted(f"{self.what}: rank {self.peer} failed (see its error)")
        if code != _META:
            raise RuntimeError(f"{self.what}: unknown message code {code} from rank {self.peer}")
        words = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.recv(words, self.peer, group=self.group, tag=self.tag)
        self.recv_meta = _decode(words.tolist())
        self._slots.clear()
        self._spare = None  # of the old size
        buf, views = self._slot(slot)
        wire = self._wire(buf)
        dist.recv(wire, self.peer, group=self.group, tag=self.tag)
        code = int(wire[:_HEAD].view(torch.int64)[0])
        self._agree(code)
        if code == _ABORT:
            raise PipeAborted(f"{self.what}: rank {self.peer} failed (see its error)")
        out = self._gathered(buf, wire, views)
        self._post_early()
        return out

    def _landed(self, slot: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The slot's buffer holding the next message: the early receive's (the slot's old
        buffer becoming the spare), or one received now."""
        if self._early is None:
            buf, views = self._slot(slot)
            dist.recv(self._wire(buf), self.peer, group=self.group, tag=self.tag)
            return buf, views
        work, landed = self._early
        self._early = None
        work.wait()
        self._spare = self._slots.get(slot)
        self._slots[slot] = landed
        return landed

    def _post_early(self) -> None:
        """Post the receive of the batch's next message (unsplit channels: a split one's
        receivers agree on each message's code first)."""
        if self.expected == 0 or self.split is not None or self.recv_meta is None:
            return
        spare, self._spare = self._spare, None
        if spare is None:
            spare = self._recv_buffer()
        self._early = (dist.irecv(spare[0], self.peer, group=self.group, tag=self.tag), spare)
        self.early_receives += 1

    def _agree(self, code: int) -> None:
        """Split: the receivers of a stage learn each other's message codes before they
        gather (one 2-word all-reduce), so that when only some of the senders failed, or
        changed shape, every receiver raises instead of waiting in the gather for a part
        that never comes ([Note: partitioned p2p])."""
        if self.split is None:
            return
        both = torch.tensor([code, -code], dtype=torch.int64, device=self.device)
        all_reduce(both, op=ReduceOp.MAX, group=self.split)
        hi, lo = int(both[0]), -int(both[1])
        if hi == lo:
            return
        if _ABORT in (hi, code):
            raise PipeAborted(
                f"{self.what}: a rank sending to this stage's tensor group failed (see its error)"
            )
        raise ValueError(
            f"{self.what}: the tensor-parallel ranks of the sending stage changed shape "
            "differently (some renegotiated, some did not): with pipeline.pipe_partitioned / "
            "grad_partitioned their tensors must be the same; call reset_activation_shape() "
            "on every rank, or set both keys to false"
        )

    def _wire(self, buf: torch.Tensor) -> torch.Tensor:
        """Where a message lands in a slot's buffer. Split: this rank's part in its place in
        the payload and the header in the 16 bytes before it (the previous part's tail,
        which the gather then overwrites), so the gather copies nothing of its own."""
        if self.split is None:
            return buf
        assert self.recv_meta is not None
        c = _part_size(self.recv_meta, self.split.size)
        at = self.split.rank * c
        return buf[at : at + _HEAD + c]

    def _gathered(
        self, buf: torch.Tensor, wire: torch.Tensor, views: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """The slot's tensors, the other ranks' parts gathered around this one's (the wire
        after its header) when split."""
        if self.split is not None:
            all_gather_bucket(buf[_HEAD:], wire[_HEAD:], group=self.split).wait()
        return views

    def _slot(self, slot: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        assert self.recv_meta is not None
        if slot not in self._slots:
            self._slots[slot] = self._recv_buffer()
        return self._slots[slot]

    def _recv_buffer(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A buffer for one message of recv_meta (split: room for every rank's part), and
        the views of its tensors."""
        assert self.recv_meta is not None
        size = _layout(self.recv_meta)[1]
        if self.split is not None:
            size = _HEAD + self.split.size * _part_size(self.recv_meta, self.split.size)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buf, _views(buf, self.recv_meta)


_PRINT_CHUNK = 1 << 20  # elements per step of a fingerprint (bounded scratch memory)


def _fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    """What _check_replicated compares: a non-float tensor's bytes (a digest); a float
    tensor's norm and two projections on random signs drawn alike on every rank (tensors
    that differ by d differ in a projection by about |d|)."""
    x = t.detach().reshape(-1)
    if not x.is_floating_point():
        data = x.contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return ("bytes", hashlib.blake2b(data, digest_size=16).hexdigest())
    acc = torch.zeros(3, dtype=torch.float64, device=x.device)
    # drawn on the host (a device's random stream can depend on its model, its SM count),
    # once: every chunk is projected on the same signs
    gen = torch.Generator().manual_seed(0x5EED)
    signs = torch.randint(0, 4, (min(x.numel(), _PRINT_CHUNK),), generator=gen, dtype=torch.int8)
    signs = signs.to(x.device)
    for i in range(0, x.numel(), _PRINT_CHUNK):
        c = x[i : i + _PRINT_CHUNK].double()
        r = signs[: c.numel()]
        acc[0] += (c * c).sum()
        acc[1] += (c * ((r & 1) * 2 - 1)).sum()
        acc[2] += (c * ((r >> 1) * 2 - 1)).sum()
    norm, p1, p2 = acc.tolist()
    return ("float", math.sqrt(norm), p1, p2)


def _disagreement(
    mine: list[Any], theirs: list[Any], tensors: tuple[torch.Tensor, ...]
) -> str | None:
    """Why two ranks' fingerprints show different tensors, or None."""
    if mine[0] != theirs[0]:
        return f"shapes ({mine[0]}) against ({theirs[0]})"
    for i, (a, b, t) in enumerate(zip(mine[1:], theirs[1:], tensors)):
        if a[0] == "bytes":
            if a != b:
                return f"tensor {i}'s values"
            continue
        if [math.isfinite(v) for v in a[1:]] != [math.isfinite(v) for v in b[1:]]:
            return f"tensor {i}'s values (not finite on one rank)"
        # rounding: a few units in the last place of the dtype, relative to the norm
        tol = max(1e-3, 8 * torch.finfo(t.dtype).eps) * max(a[1], b[1])
        if max(abs(x - y) for x, y in zip(a[1:], b[1:])) > tol:
            return f"tensor {i}'s values"
    return None


def _shapes(meta: Meta) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    return tuple((d, s) for d, _, s in meta)
