"""Point-to-point channels between neighbouring pipeline stages.

[Note: pipeline p2p]
A PipeChannel is one direction between two ranks (activations go down the pipe, gradients
come back up). What travels is a tuple of tensors. The shapes, dtypes and requires_grad flags
are sent once (the "meta"); after that each message is a one-word header and the tensors
themselves, received into buffers that are reused between micro-batches. The header is what
keeps a failing pipeline from hanging:
  OK    the tensors follow, in the negotiated meta;
  META  a new meta follows, then the tensors (dynamic shapes, or the first message);
  ABORT the sender failed: the receiver raises (and aborts onwards), instead of waiting for
        tensors that never come.
Sends are non-blocking (the receiver posts its receives in schedule order, so a schedule
that is valid when simulated in one process cannot deadlock); each send's tensors are kept
alive until its work completes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

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


def _encode(meta: Meta) -> torch.Tensor:
    words = [len(meta)]
    for dtype, grad, shape in meta:
        words += [_CODE[dtype], int(grad), len(shape), *shape]
    return torch.tensor(words, dtype=torch.int64)


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


class PipeChannel:
    """One direction between this rank and `peer` (a global rank). `what` names the traffic
    in messages ("activations from stage 1")."""

    def __init__(
        self, peer: int, what: str, dynamic: bool = False, tag: int = 0, max_pending: int = 8
    ) -> None:
        self.peer = peer
        self.tag = tag  # per engine: a message left over from a failed run never matches
        self.what = what
        self.dynamic = dynamic  # shapes may change between messages
        self.max_pending = max_pending
        self.sent_meta: Meta | None = None
        self.recv_meta: Meta | None = None
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        self._pending: deque[tuple[Any, tuple[torch.Tensor, ...]]] = deque()
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
        if meta == self.sent_meta:
            self._post(torch.tensor([_OK, 0], dtype=torch.int64))
        else:
            if (
                self.sent_meta is not None
                and not self.dynamic
                and _shapes(meta) != _shapes(self.sent_meta)
            ):
                self.abort()
                raise ValueError(
                    f"{self.what} changed shape mid-run: ({describe(self.sent_meta)}) became "
                    f"({describe(meta)}). Keep a stage's output shapes fixed (pad the batch), or "
                    "pass dynamic_shape=True to PipelineModule to renegotiate them per message"
                )
            words = _encode(meta)
            self._post(torch.tensor([_META, words.numel()], dtype=torch.int64))
            self._post(words)
            self.sent_meta = meta
        for t in tensors:
            self._post(t.detach().contiguous())

    def _post(self, t: torch.Tensor) -> None:
        work = dist.isend(t, self.peer, tag=self.tag)
        self._pending.append((work, (t,)))
        while len(self._pending) > self.max_pending:
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
        word = torch.tensor([_ABORT, 0], dtype=torch.int64)
        try:
            work = dist.isend(word, self.peer, tag=self.tag)
        except Exception:  # noqa: BLE001 - the peer may be gone already
            return
        # the send reads `word` after this returns: keep it alive past this channel's life
        _ABORTS.append((work, word))

    # -- receiving --
    def recv(self, slot: int = 0) -> tuple[torch.Tensor, ...]:
        """The next message's tensors, in this slot's reused buffers (a slot's tensors stay
        valid until the same slot receives again)."""
        head = torch.empty(2, dtype=torch.int64)  # [code, meta length]
        dist.recv(head, self.peer, tag=self.tag)
        code, n = int(head[0]), int(head[1])
        if code == _ABORT:
            raise PipeAborted(f"{self.what}: rank {self.peer} failed (see its error)")
        if code == _META:
            words = torch.empty(n, dtype=torch.int64)
            dist.recv(words, self.peer, tag=self.tag)
            self.recv_meta = _decode(words.tolist())
            self._buffers.clear()
        if self.recv_meta is None:
            raise RuntimeError(f"{self.what}: tensors arrived before their shapes")
        bufs = self._buffers.get(slot)
        if bufs is None:
            bufs = tuple(torch.empty(s, dtype=d) for d, _, s in self.recv_meta)
            self._buffers[slot] = bufs
        for b in bufs:
            dist.recv(b, self.peer, tag=self.tag)
        return bufs


def _shapes(meta: Meta) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    return tuple((d, s) for d, _, s in meta)
