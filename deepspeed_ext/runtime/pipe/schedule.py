"""Pipeline schedules as instruction streams (upstream's names: TrainSchedule,
InferenceSchedule, and the instructions the engine executes).

A schedule is what one stage does for one batch of `micro_batches` micro-batches: `steps()`
yields lists of instructions. 1F1B (TrainSchedule): stage s runs min(stages - s - 1, m)
forwards to fill the pipe, then alternates one forward and one backward, then drains the
remaining backwards; at most stages - s micro-batches are in flight, which bounds the
activations a stage keeps. Sends never block ([Note: pipeline p2p]), so a stream that is
valid when simulated in one process cannot deadlock. ZeroBubbleH1Schedule splits each
backward in two to fill the bubble; InterleavedTrainSchedule gives each rank several chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class PipeInstruction:
    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PipeInstruction) and (self.name, self.kwargs) == (
            other.name,
            other.kwargs,
        )

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    pass


class CommitP2P(PipeInstruction):
    """Upstream's DualPipeV launches its queued sends and receives at this instruction.
    Here sends go out at once and receives are posted ahead ([Note: pipeline p2p]), so
    there is nothing to commit: the engine accepts it (a user's own schedule may yield it)
    and does nothing."""


class ReduceGrads(PipeInstruction):
    pass


class ReduceTiedGrads(PipeInstruction):
    pass


class BufferOpInstruction(PipeInstruction):
    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)
        self.buffer_id = buffer_id


def chunk_and_buffer(cmd: PipeInstruction) -> tuple[int, int]:
    """The (model chunk, buffer id) a buffer instruction names (chunk 0 without chunks)."""
    return int(cmd.kwargs.get("chunk", 0)), int(cmd.kwargs["buffer_id"])


class LoadMicroBatch(BufferOpInstruction):
    pass


class ForwardPass(BufferOpInstruction):
    pass


class BackwardPass(BufferOpInstruction):
    pass


class BackwardInputPass(BufferOpInstruction):
    """B of a split backward (zero-bubble schedules): the stage inputs' gradients only."""


class BackwardWeightPass(BufferOpInstruction):
    """W of a split backward: the weight gradients of a micro-batch whose B ran."""


class SendActivation(BufferOpInstruction):
    pass


class RecvActivation(BufferOpInstruction):
    pass


class SendGrad(BufferOpInstruction):
    pass


class RecvGrad(BufferOpInstruction):
    pass


class PipeSchedule:
    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches}: a batch has at least one")
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id={stage_id} is not one of {stages} stages")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    # upstream's read-only names for the same
    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError  # the abstract base: TrainSchedule and InferenceSchedule

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def _forward(self, mb: int) -> list[PipeInstruction]:
        buf = mb % self.num_pipe_buffers()
        return forward_cmds(buf, self.is_first_stage, self.is_last_stage)

    def _backward(self, mb: int) -> list[PipeInstruction]:
        buf = mb % self.num_pipe_buffers()
        return backward_cmds(buf, self.is_first_stage, self.is_last_stage)


def forward_cmds(
    buf: int, first: bool, last: bool, local_in: bool = False, local_out: bool = False, **chunk: int
) -> list[PipeInstruction]:
    """One micro-batch's forward on a (virtual) stage: load or receive, run, send on.
    `local_in` / `local_out`: the previous / next virtual stage is on this rank (DualPipeV's
    turn), which hands over in-process instead of a message."""
    cmds: list[PipeInstruction] = []
    if first or last:
        cmds.append(LoadMicroBatch(buf, **chunk))
    if not (first or local_in):
        cmds.append(RecvActivation(buf, **chunk))
    cmds.append(ForwardPass(buf, **chunk))
    if not (last or local_out):
        cmds.append(SendActivation(buf, **chunk))
    return cmds


def backward_cmds(
    buf: int,
    first: bool,
    last: bool,
    split: bool = False,
    local_in: bool = False,
    local_out: bool = False,
    **chunk: int,
) -> list[PipeInstruction]:
    """One micro-batch's backward (its B alone when `split`): receive, run, send back; the
    gradients of a neighbour on this rank (`local_in` / `local_out`, as forward_cmds') are
    handed over in-process."""
    cmds: list[PipeInstruction] = []
    if not (last or local_out):
        cmds.append(RecvGrad(buf, **chunk))
    cmds.append(BackwardInputPass(buf, **chunk) if split else BackwardPass(buf, **chunk))
    if not (first or local_in):
        cmds.append(SendGrad(buf, **chunk))
    return cmds


class TrainSchedule(PipeSchedule):
    """1F1B with the batch's optimizer step at the end."""

    def num_pipe_buffers(self) -> int:
        return max(1, min(self.stages - self.stage_id, self.micro_batches))

    def order(self) -> list[tuple[str, int]]:
        """("F" | "B", micro-batch) in execution order."""
        m = self.micro_batches
        warmup = min(self.stages - self.stage_id - 1, m)
        seq = [("F", i) for i in range(warmup)]
        f, b = warmup, 0
        while f < m:
            seq += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        seq += [("B", i) for i in range(b, m)]
        return seq

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for kind, mb in self.order():
            yield self._forward(mb) if kind == "F" else self._backward(mb)
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


class ZeroBubbleH1Schedule(TrainSchedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): each backward is split into B
    (input gradients, which the previous stage waits for) and W (weight gradients, which
    nobody waits for). Stage s starts its W passes s micro-batches late, so that every stage
    holds at most `stages` micro-batches, as stage 0 of 1F1B does, and the W passes it has
    put off fill the waits of the drain. With F = B = W the idle time is a third of 1F1B's:
    (p-1)*F per stage instead of (p-1)*(F+B+W)."""

    def num_pipe_buffers(self) -> int:
        return max(1, min(self.stages, self.micro_batches))

    def order(self) -> list[tuple[str, int]]:
        """("F" | "B" | "W", micro-batch) in execution order."""
        m, s = self.micro_batches, self.stage_id
        warmup = min(self.stages - s - 1, m)
        seq = [("F", i) for i in range(warmup)]
        f, b, w = warmup, 0, 0
        while f < m:
            seq += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
            if b - w > s:
                seq.append(("W", w))
                w += 1
        while b < m:  # the drain: a put-off W after each B
            seq.append(("B", b))
            b += 1
            if w < b:
                seq.append(("W", w))
                w += 1
        seq += [("W", i) for i in range(w, m)]
        return seq

    def steps(self) -> Iterator[list[PipeInstruction]]:
        n = self.num_pipe_buffers()
        for kind, mb in self.order():
            if kind == "F":
                yield self._forward(mb)
            elif kind == "B":
                yield backward_cmds(mb % n, self.is_first_stage, self.is_last_stage, split=True)
            else:
                yield [BackwardWeightPass(mb % n)]
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


class DataParallelSchedule(PipeSchedule):
    """Upstream's schedule for one stage (plain data parallelism): each micro-batch loaded,
    run forward and backward; then the gradients reduced and the optimizer stepped."""

    def num_pipe_buffers(self) -> int:
        return 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        if self.stages != 1:
            raise ValueError(f"DataParallelSchedule runs one stage, not {self.stages}")
        for _ in range(self.micro_batches):
            yield [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
        yield [ReduceGrads(), OptimizerStep()]


class InferenceSchedule(PipeSchedule):
    """Forwards only; two buffers alternate (a received input is consumed by its forward).
    With `chunks` model chunks per rank (interleaved), micro-batches go in groups of
    `stages` through chunk 0, then chunk 1, ...; instructions carry `chunk=`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.chunks = chunks

    def num_pipe_buffers(self) -> int:
        return 2

    def steps(self) -> Iterator[list[PipeInstruction]]:
        if self.chunks == 1:
            for mb in range(self.micro_batches):
                yield self._forward(mb)
            return
        p, v, last = self.stages, self.chunks, self.stages * self.chunks - 1
        for g in range(0, self.micro_batches, p):
            for c in range(v):
                vs = c * p + self.stage_id
                for mb in range(g, min(g + p, self.micro_batches)):
                    yield forward_cmds(mb, vs == 0, vs == last, chunk=c)


class InterleavedTrainSchedule(PipeSchedule):
    """Interleaved 1F1B (virtual stages): each rank holds `chunks` model chunks, chunk c of
    rank r being virtual stage c*stages + r, so the pipe fills v times faster and the bubble
    shrinks to (p-1)/(v*m+p-1). Micro-batches go through in groups of `stages`: forward
    micro-step k runs chunk (k // p) % v on micro-batch (k // (p*v))*p + k % p; backward
    micro-steps visit the chunks in reverse. Instructions carry `chunk=`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2) -> None:
        super().__init__(micro_batches, stages, stage_id)
        if chunks < 1:
            raise ValueError(f"chunks={chunks}: at least one model chunk per rank")
        if chunks > 1 and micro_batches % stages:
            raise ValueError(
                f"the interleaved schedule runs micro-batches in groups of the {stages} "
                f"stages: gradient_accumulation_steps={micro_batches} is not a multiple of "
                f"{stages}; use {(micro_batches // stages + 1) * stages}"
            )
        self.chunks = chunks

    def num_pipe_buffers(self) -> int:
        return self.micro_batches  # per chunk: buffer = micro-batch index

    def _fwd(self, k: int) -> tuple[int, int]:
        p, v = self.stages, self.chunks
        return (k // p) % v, (k // (p * v)) * p + k % p

    def _bwd(self, k: int) -> tuple[int, int]:
        c, mb = self._fwd(k)
        return self.chunks - 1 - c, mb

    def order(self) -> list[tuple[str, int, int]]:
        """("F" | "B", chunk, micro-batch) in execution order."""
        p, v, m, r = self.stages, self.chunks, self.micro_batches, self.stage_id
        total = m * v
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total) if v > 1 else min(p - r - 1, m)
        seq = [("F", *self._fwd(k)) for k in range(warmup)]
        for i in range(total - warmup):
            seq += [("F", *self._fwd(warmup + i)), ("B", *self._bwd(i))]
        seq += [("B", *self._bwd(i)) for i in range(total - warmup, total)]
        return seq

    def _first(self, c: int) -> bool:
        return c == 0 and self.stage_id == 0

    def _last(self, c: int) -> bool:
        return c == self.chunks - 1 and self.stage_id == self.stages - 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for kind, c, mb in self.order():
            make = forward_cmds if kind == "F" else backward_cmds
            yield make(mb, self._first(c), self._last(c), chunk=c)
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


class DualPipeVSchedule(PipeSchedule):
    """DualPipeV (DeepSeek-V3): rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1) of
    2p; micro-batches go out through the chunk-0 stages, turn around on the last rank and
    come back through the chunk-1 stages to rank 0, which loads them and computes the loss.
    Rank r runs, with F0/B0 chunk 0's forward/backward and each (kind, chunk) in micro-batch
    order:  2(p-r-1) F0 | (r+1) x F0 F1 | (p-r-1) x B1 F1 | m-2p+r+1 x F0 B1 F1 B0 |
    (p-r-1) x B1 F1 B0 | (r+1) x B1 B0 | (p-r-1) x B0;  the weight gradients stay inside
    each backward (as upstream's), or with `split_backward` each backward is split as ZB-H1
    splits it and its weight pass W runs right after the input gradients are sent: the
    neighbour waiting for them gets them W earlier (with F = B = W per half-stage, idle
    time at p = 4 falls from 11 units to 6, 1F1B's being 18). Training needs m >= 2p.
    forward_only (eval): rank r runs min(m, 2(p-r)-1) F0 first, then alternates F1 and F0:
    never more in flight than the round trip to the turn and back needs, so no stream
    waits on one that waits on it.
    Instructions carry `chunk=` (upstream's phase) and buffer = micro-batch."""

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        forward_only: bool = False,
        split_backward: bool = False,
    ) -> None:
        super().__init__(micro_batches, stages, stage_id)
        if not forward_only and micro_batches < 2 * stages:
            raise ValueError(
                f"DualPipeV trains at least 2 * stages = {2 * stages} micro-batches a batch, "
                f"not {micro_batches}: raise gradient_accumulation_steps"
            )
        self.forward_only = forward_only
        self.split_backward = split_backward
        self.chunks = 2

    def num_pipe_buffers(self) -> int:
        return self.micro_batches  # per chunk: buffer = micro-batch index

    def order(self) -> list[tuple[str, int, int]]:
        """("F" | "B", chunk, micro-batch) in execution order."""
        p, r, m = self.stages, self.stage_id, self.micro_batches
        done = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        seq: list[tuple[str, int, int]] = []

        def run(*ops: str) -> None:
            for op in ops:  # "F0", "B1", ...
                key = (op[0], int(op[1]))
                seq.append((op[0], key[1], done[key]))
                done[key] += 1

        if self.forward_only:
            run(*["F0"] * min(m, 2 * (p - r) - 1))
            while done[("F", 1)] < m:
                run("F1")
                if done[("F", 0)] < m:
                    run("F0")
            return seq
        plan = [
            (2 * (p - r - 1), ("F0",)),
            (r + 1, ("F0", "F1")),
            (p - r - 1, ("B1", "F1")),
            (m - 2 * p + r + 1, ("F0", "B1", "F1", "B0")),
            (p - r - 1, ("B1", "F1", "B0")),
            (r + 1, ("B1", "B0")),
            (p - r - 1, ("B0",)),
        ]
        for times, ops in plan:
            for _ in range(times):
                run(*ops)
        return seq

    def steps(self) -> Iterator[list[PipeInstruction]]:
        p, r = self.stages, self.stage_id
        turn = r == p - 1  # chunk 0's next stage is chunk 1, on this rank
        for kind, c, mb in self.order():
            ends = {"first": c == 0 and r == 0, "last": c == 1 and r == 0}
            local = {"local_in": turn and c == 1, "local_out": turn and c == 0}
            if kind == "F":
                yield forward_cmds(mb, **ends, **local, chunk=c)
                continue
            split = self.split_backward
            cmds = backward_cmds(mb, **ends, split=split, **local, chunk=c)
            yield cmds + ([BackwardWeightPass(mb, chunk=c)] if split else [])
        if not self.forward_only:
            yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
