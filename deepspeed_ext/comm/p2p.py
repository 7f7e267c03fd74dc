"""Point-to-point channels between neighbouring pipeline stages.

[Note: pipeline p2p]
A PipeChannel is one direction between two ranks (activations go down the pipe, gradients
come back up). What travels is a tuple of tensors. Their shapes, dtypes and requires_grad
flags (the "meta") are sent once; after that each transfer is ONE message, a packet: a
16-byte header then every tensor's bytes (16-byte aligned), received into a per-slot buffer
that is reused between micro-batches (the tensors handed out are views into it). The
header's code is what keeps a failing pipeline from hanging:
  OK    the tensors follow, in the negotiated meta;
  META  the meta changed (dynamic shapes): the new meta and then a new packet follow;
  ABORT the sender failed: the receiver raises (and aborts onwards), instead of waiting for
        tensors that never come.
Before the first packet the receiver knows no size, so the first message (and an abort that
comes before any packet) is a 2-word hello [code, meta length]. Sends are non-blocking (the
receiver posts its receives in schedule order, so a schedule that is valid when simulated in
one process cannot deadlock); each send's buffer is kept alive until its work completes.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from .checked import dist
from .sharded import collective_device

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


def _layout(meta: Meta) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a packet, and the packet's size."""
    offsets, off = [], _HEAD
    for d, _, shape in meta:
        offsets.append(off)
        n = math.prod(shape) * d.itemsize
        off += (n + 15) // 16 * 16
    return offsets, off


def _views(buf: torch.Tensor, meta: Meta) -> tuple[torch.Tensor, ...]:
    offsets, _ = _layout(meta)
    out = []
    for off, (d, _, shape) in zip(offsets, meta):
        n = math.prod(shape) * d.itemsize
        out.append(buf[off : off + n].view(d).view(shape))
    return tuple(out)


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
    ) -> None:
        self.device = device if device is not None else collective_device()
        self.peer = peer
        self.tag = tag  # per engine: a message left over from a failed run never matches
        self.what = what
        self.dynamic = dynamic  # shapes may change between messages
        self.max_pending = max_pending
        self.sent_meta: Meta | None = None
        self.recv_meta: Meta | None = None
        self.reshape_next = False  # the next send may change shape (renegotiate())
        self._slots: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._pending: deque[tuple[Any, torch.Tensor]] = deque()
        self.aborted = False

    # -- sending --
    def send(self, tensors: tuple[torch.Tensor, ...]) -> None:
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{self.what}: element {i} is a {type(t).__name__}; a pipeline stage must "
                    "pass tensors (or a tuple of tensors) to the next stage"
                )
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
            words = _encode(meta, self.device)
            if self.sent_meta is None:
                self._post(self._hello(_META, words.numel()))
            else:  # announced in a packet of the size the receiver expects
                self._post(self._packet(self.sent_meta, _META, words.numel()))
            self._post(words)
            self.sent_meta = meta
        self.reshape_next = False
        packet = self._packet(meta, _OK, 0)
        for view, t in zip(_views(packet, meta), tensors):
            view.copy_(t.detach())
        self._post(packet)

    def renegotiate(self) -> None:
        """The next send may change shape: its new meta goes first, as with dynamic shapes
        (the receiver needs no call: it takes a new meta whenever one comes)."""
        self.reshape_next = True

    def _hello(self, code: int, n: int) -> torch.Tensor:
        return torch.tensor([code, n], dtype=torch.int64, device=self.device)

    def _packet(self, meta: Meta, code: int, n: int) -> torch.Tensor:
        buf = torch.empty(_layout(meta)[1], dtype=torch.uint8, device=self.device)
        buf[:_HEAD].view(torch.int64).copy_(self._hello(code, n))
        return buf

    def _post(self, t: torch.Tensor) -> None:
        work = dist.isend(t, self.peer, tag=self.tag)
        self._pending.append((work, t))
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()  # its buffer may go
        while len(self._pending) > self.max_pending:  # bound the memory of a fast sender
            w, _ = self._pending.popleft()
            w.wait()

    def wait_sends(self) -> None:
        while self._pending:
            w, _ = self._pending.popleft()
            w.wait()

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
            work = dist.isend(word, self.peer, tag=self.tag)
        except Exception:  # noqa: BLE001 - the peer may be gone already
            return
        # the send reads `word` after this returns: keep it alive past this channel's life
        _ABORTS.append((work, word))

    # -- receiving --
    def recv(self, slot: int = 0) -> tuple[torch.Tensor, ...]:
        """The next message's tensors: views into this slot's reused buffer (valid until the
        same slot receives again)."""
        if self.recv_meta is None:  # the hello: [code, meta length]
            head = torch.empty(2, dtype=torch.int64, device=self.device)
            dist.recv(head, self.peer, tag=self.tag)
            code, n = head.tolist()
        else:
            buf, views = self._slot(slot)
            dist.recv(buf, self.peer, tag=self.tag)
            code, n = buf[:_HEAD].view(torch.int64).tolist()  # one host read per message
            if code == _OK:
                return views
        if code == _ABORT:
            raise PipeAborted(f"{self.what}: rank {self.peer} failed (see its error)")
        if code != _META:
            raise RuntimeError(f"{self.what}: unknown message code {code} from rank {self.peer}")
        words = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.recv(words, self.peer, tag=self.tag)
        self.recv_meta = _decode(words.tolist())
        self._slots.clear()
        buf, views = self._slot(slot)
        dist.recv(buf, self.peer, tag=self.tag)
        if int(buf[:_HEAD].view(torch.int64)[0]) == _ABORT:
            raise PipeAborted(f"{self.what}: rank {self.peer} failed (see its error)")
        return views

    def _slot(self, slot: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        assert self.recv_meta is not None
        if slot not in self._slots:
            buf = torch.empty(_layout(self.recv_meta)[1], dtype=torch.uint8, device=self.device)
            self._slots[slot] = (buf, _views(buf, self.recv_meta))
        return self._slots[slot]


def _shapes(meta: Meta) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    return tuple((d, s) for d, _, s in meta)
