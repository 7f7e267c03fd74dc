"""Which receive buffer each receive of a batch's plan lands in.

A channel reuses one buffer per slot between micro-batches ([Note: pipeline p2p]); the
tensors a receive hands out are views into it, alive until the micro-batch's last use of
them on this rank. Upstream's buffer ids are not a bound when they are micro-batch indices
(the interleaved and DualPipeV schedules, where each chunk's in-flight count varies by
rank): a slot per id would keep a buffer per micro-batch, m of them per channel. So the
slots are assigned here by walking the plan in execution order: a receive takes the lowest
slot free at that point, freed after its micro-batch's last instruction that reads the
received tensors. A channel then holds as many buffers as it has micro-batches in flight,
whatever m is.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import schedule as sch

# what reads a received input: its forward, the backward that runs through the graph saved
# from it (a split backward's W too), and the send that follows (an eval forward's output
# may be the input itself)
_ACT_READERS = (
    sch.ForwardPass,
    sch.BackwardPass,
    sch.BackwardInputPass,
    sch.BackwardWeightPass,
    sch.SendActivation,
    sch.SendGrad,
)
# what reads a received gradient: the backward it seeds (a split backward's W may seed
# join nodes with it)
_GRAD_READERS = (sch.BackwardPass, sch.BackwardInputPass, sch.BackwardWeightPass)


def plan_recv_slots(plan: Iterable[list[sch.PipeInstruction]]) -> dict[int, int]:
    """id(receive instruction) -> its slot, for every RecvActivation and RecvGrad in `plan`
    (the instructions must stay alive while the map is used: ids are only unique then)."""
    cmds = [cmd for step in plan for cmd in step]
    kinds = ((sch.RecvActivation, _ACT_READERS), (sch.RecvGrad, _GRAD_READERS))
    # the position after which each receive's tensors are dead
    ends: dict[int, int] = {}
    for recv_kind, readers in kinds:
        open_: dict[tuple[int, int], int] = {}  # key -> index of the receive it holds
        for i, cmd in enumerate(cmds):
            if isinstance(cmd, recv_kind):
                open_[sch.chunk_and_buffer(cmd)] = i
                ends[i] = i
            elif isinstance(cmd, readers):
                at = open_.get(sch.chunk_and_buffer(cmd))
                if at is not None:
                    ends[at] = i
    slots: dict[int, int] = {}
    for recv_kind, _ in kinds:
        busy: dict[tuple[int, int], int] = {}  # (chunk, slot) -> end of its occupant
        for i, cmd in enumerate(cmds):
            if not isinstance(cmd, recv_kind):
                continue
            c = sch.chunk_and_buffer(cmd)[0]
            s = 0
            while busy.get((c, s), -1) >= i:
                s += 1
            busy[(c, s)] = ends[i]
            slots[id(cmd)] = s
    return slots


__all__ = ["plan_recv_slots"]
