"""plan_recv_slots: every receive's tensors stay in their slot until the micro-batch's last
read of them, and a channel needs as many slots as micro-batches in flight, not one per
micro-batch (the engine's parity tests show training still matches with the slots reused)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deepspeed_ext.runtime.pipe import schedule as sch
from deepspeed_ext.runtime.pipe.recv_slots import plan_recv_slots

Make = Callable[[int, int, int], sch.PipeSchedule]
SCHEDULES: dict[str, Make] = {
    "1f1b": lambda m, p, r: sch.TrainSchedule(m, p, r),
    "zb-h1": lambda m, p, r: sch.ZeroBubbleH1Schedule(m, p, r),
    "interleaved": lambda m, p, r: sch.InterleavedTrainSchedule(m, p, r, 2),
    "dualpipev": lambda m, p, r: sch.DualPipeVSchedule(m, p, r),
    "dualpipev-zb": lambda m, p, r: sch.DualPipeVSchedule(m, p, r, split_backward=True),
    "eval": lambda m, p, r: sch.InferenceSchedule(m, p, r),
    "eval-interleaved": lambda m, p, r: sch.InferenceSchedule(m, p, r, 2),
    "eval-dualpipev": lambda m, p, r: sch.DualPipeVSchedule(m, p, r, forward_only=True),
}
# what reads a received activation / gradient (stated here, not imported, so that the test
# does not share the planner's list)
READS = {
    sch.RecvActivation: (
        sch.ForwardPass,
        sch.BackwardPass,
        sch.BackwardInputPass,
        sch.BackwardWeightPass,
        sch.SendActivation,
        sch.SendGrad,
    ),
    sch.RecvGrad: (sch.BackwardPass, sch.BackwardInputPass, sch.BackwardWeightPass),
}


def key(cmd: sch.PipeInstruction) -> tuple[int, int]:
    return int(cmd.kwargs.get("chunk", 0)), int(cmd.buffer_id)


def check(plan: list[list[sch.PipeInstruction]]) -> dict[tuple[str, int], int]:
    """Walk the plan: each read of a micro-batch's received tensors finds them still in
    their slot. Returns the slots used per (receive kind, chunk)."""
    slots = plan_recv_slots(plan)
    cmds = [cmd for step in plan for cmd in step]
    used: dict[tuple[str, int], int] = {}
    for kind, readers in READS.items():
        holder: dict[tuple[int, int], int] = {}  # (chunk, slot) -> the receive in it
        latest: dict[tuple[int, int], int] = {}  # key -> its latest receive
        for i, cmd in enumerate(cmds):
            if isinstance(cmd, kind):
                c, s = key(cmd)[0], slots[id(cmd)]
                holder[(c, s)] = latest[key(cmd)] = i
                used[(kind.__name__, c)] = max(used.get((kind.__name__, c), 0), s + 1)
            elif isinstance(cmd, readers) and key(cmd) in latest:
                recv = latest[key(cmd)]
                at = (key(cmd)[0], slots[id(cmds[recv])])
                taken = cmds[holder[at]]
                assert holder[at] == recv, f"{cmd} reads slot {at}, since taken by {taken}"
    return used


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p", [2, 4])
def test_reads_find_their_tensors_and_slots_do_not_grow_with_micro_batches(
    name: str, p: int
) -> None:
    make = SCHEDULES[name]
    m = 4 * p
    for r in range(p):
        few = check(list(make(m, p, r).steps()))
        many = check(list(make(4 * m, p, r).steps()))
        assert many == few, (r, few, many)
        assert all(n <= 2 * p for n in many.values()), many


def test_one_slot_per_micro_batch_would_be_what_a_buffer_id_gives() -> None:
    """The interleaved schedule's buffer ids are micro-batch indices: slots by id would be
    m per channel where the plan needs a few."""
    m, p = 32, 4
    plan = list(sch.InterleavedTrainSchedule(m, p, 1, 2).steps())
    ids = {key(c) for step in plan for c in step if isinstance(c, sch.RecvActivation)}
    assert len(ids) == 2 * m
    assert max(check(plan).values()) < 10
