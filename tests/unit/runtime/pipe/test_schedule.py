"""The schedules as instruction streams, checked by simulating every stage in one process:
blocking receives, non-blocking sends. Every micro-batch is forwarded and backwarded once per
stage, in order; no stream deadlocks; in-flight activations stay within the buffers."""

from __future__ import annotations

from collections import deque

import pytest

from deepspeed_ext.runtime.pipe import schedule as sch


def simulate(make: type, m: int, p: int) -> list[list[tuple[str, int]]]:
    """Run all stages' streams; returns each stage's (kind, micro-batch) compute order."""
    streams = [[c for step in make(m, p, s).steps() for c in step] for s in range(p)]
    pc = [0] * p
    links: dict[tuple[str, int], deque[int]] = {}  # (kind, receiving stage) -> micro-batches
    fwd = [0] * p
    bwd = [0] * p
    wgt = [0] * p
    done: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    live = [0] * p  # activations held (forwarded, weight gradients not yet computed)
    while any(pc[s] < len(streams[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pc[s] < len(streams[s]):
                cmd = streams[s][pc[s]]
                if isinstance(cmd, sch.RecvActivation):
                    q = links.setdefault(("act", s), deque())
                    if not q:
                        break
                    assert q.popleft() == fwd[s]
                elif isinstance(cmd, sch.RecvGrad):
                    q = links.setdefault(("grad", s), deque())
                    if not q:
                        break
                    assert q.popleft() == bwd[s]
                elif isinstance(cmd, sch.ForwardPass):
                    done[s].append(("F", fwd[s]))
                    assert cmd.buffer_id == fwd[s] % make(m, p, s).num_pipe_buffers()
                    fwd[s] += 1
                    live[s] += 1
                    assert (
                        live[s] <= make(m, p, s).num_pipe_buffers() or make is sch.InferenceSchedule
                    )
                    if make is sch.InferenceSchedule:
                        live[s] -= 1
                elif isinstance(cmd, sch.SendActivation):
                    links.setdefault(("act", s + 1), deque()).append(fwd[s] - 1)
                elif isinstance(cmd, (sch.BackwardPass, sch.BackwardInputPass)):
                    done[s].append(("B", bwd[s]))
                    assert cmd.buffer_id == bwd[s] % make(m, p, s).num_pipe_buffers()
                    bwd[s] += 1
                    if isinstance(cmd, sch.BackwardPass):
                        live[s] -= 1
                elif isinstance(cmd, sch.BackwardWeightPass):
                    assert wgt[s] < bwd[s], "W before its B"
                    assert cmd.buffer_id == wgt[s] % make(m, p, s).num_pipe_buffers()
                    done[s].append(("W", wgt[s]))
                    wgt[s] += 1
                    live[s] -= 1
                elif isinstance(cmd, sch.SendGrad):
                    links.setdefault(("grad", s - 1), deque()).append(bwd[s] - 1)
                pc[s] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock: m={m} p={p} at {pc}")
    return done


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_train_schedule_runs_every_micro_batch_once_without_deadlock(m: int, p: int) -> None:
    done = simulate(sch.TrainSchedule, m, p)
    for s in range(p):
        assert [i for k, i in done[s] if k == "F"] == list(range(m))
        assert [i for k, i in done[s] if k == "B"] == list(range(m))
        warmup = min(p - s - 1, m)
        assert [k for k, _ in done[s][:warmup]] == ["F"] * warmup  # then 1F1B
        last = list(sch.TrainSchedule(m, p, s).steps())[-1]
        assert last == [sch.ReduceTiedGrads(), sch.ReduceGrads(), sch.OptimizerStep()]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_zero_bubble_h1_schedule(m: int, p: int) -> None:
    done = simulate(sch.ZeroBubbleH1Schedule, m, p)
    for s in range(p):
        for kind in "FBW":
            assert [i for k, i in done[s] if k == kind] == list(range(m))
        # every stage holds at most p micro-batches, as stage 0 of 1F1B does
        assert sch.ZeroBubbleH1Schedule(m, p, s).num_pipe_buffers() == min(p, m)


def timed(orders: list[list[tuple]], cost: dict[str, float], v_layout: bool = False) -> float:
    """Makespan of per-rank orders: (kind, micro-batch) entries, one stage per rank, or with
    `v_layout` DualPipeV's (kind, chunk, micro-batch) over 2p virtual stages. F waits for the
    previous stage's F, B for this stage's F and the next stage's B, W for this stage's B;
    transfers are free."""
    p = len(orders)
    last = 2 * p - 1 if v_layout else p - 1
    end: dict[tuple[str, int, int], float] = {}
    clock, pc = [0.0] * p, [0] * p
    while any(pc[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pc[r] < len(orders[r]):
                kind, *where, mb = orders[r][pc[r]]
                s = _v_stage(r, where[0], p) if v_layout else r
                deps = {"F": [("F", mb, s - 1)] if s else [], "W": [("B", mb, s)]}.get(
                    kind, [("F", mb, s)] + ([("B", mb, s + 1)] if s < last else [])
                )
                if any(d not in end for d in deps):
                    break
                clock[r] = max([clock[r]] + [end[d] for d in deps]) + cost[kind]
                end[(kind, mb, s)] = clock[r]
                pc[r] += 1
                moved = True
        assert moved, "deadlock"
    return max(clock)


@pytest.mark.parametrize("m", [4, 8, 16])
def test_zero_bubble_h1_idles_a_third_of_1f1b(m: int) -> None:
    """With F = B = W, 1F1B idles (p-1)*(F+B+W) per stage and ZB-H1 (p-1)*F."""
    p = 4
    fused = timed([sch.TrainSchedule(m, p, s).order() for s in range(p)], {"F": 1, "B": 2})
    split = timed(
        [sch.ZeroBubbleH1Schedule(m, p, s).order() for s in range(p)], {"F": 1, "B": 1, "W": 1}
    )
    assert fused - 3 * m == 3 * (p - 1)
    assert split - 3 * m == p - 1


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_inference_schedule(m: int, p: int) -> None:
    done = simulate(sch.InferenceSchedule, m, p)
    for s in range(p):
        assert done[s] == [("F", i) for i in range(m)]


def test_first_and_last_stages_load_data_middle_stages_do_not() -> None:
    def loads(s: int) -> int:
        return sum(
            isinstance(c, sch.LoadMicroBatch)
            for step in sch.TrainSchedule(4, 3, s).steps()
            for c in step
        )

    assert [loads(s) for s in range(3)] == [4, 0, 4]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="micro_batches=0"):
        sch.TrainSchedule(0, 2, 0)
    with pytest.raises(ValueError, match="stage_id=2"):
        sch.TrainSchedule(4, 2, 2)


def _ring_stage(r: int, c: int, p: int) -> int:
    return c * p + r


def _ring_holder(v: int, p: int) -> tuple[int, int]:
    return v % p, v // p


def _v_stage(r: int, c: int, p: int) -> int:
    return r if c == 0 else 2 * p - 1 - r


def _v_holder(v: int, p: int) -> tuple[int, int]:
    return (v, 0) if v < p else (2 * p - 1 - v, 1)


def simulate_chunks(
    streams: list[list[sch.PipeInstruction]], p: int, v_layout: bool = False
) -> list[list[tuple]]:
    """Streams with model chunks: chunk c of rank r is virtual stage c*p + r (interleaved:
    rank 0 receives chunk c+1's input from rank p-1's chunk c) or, with `v_layout`,
    DualPipeV's r (c=0) or 2p-1-r (c=1). A send goes to the rank holding the next
    (activations) or previous (gradients) virtual stage; neighbours on one rank (DualPipeV's
    turn) exchange no message, the later one running after the earlier. Per-edge FIFO
    order, B after its F and W after its B are checked."""
    stage_of, holder = (_v_stage, _v_holder) if v_layout else (_ring_stage, _ring_holder)
    pc = [0] * p
    links: dict[tuple[str, int, int], deque[int]] = {}  # (kind, rank, chunk) -> micro-batches
    done: list[list[tuple]] = [[] for _ in range(p)]
    ran: set[tuple[str, int, int]] = set()  # (kind, virtual stage, micro-batch)
    while any(pc[r] < len(streams[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pc[r] < len(streams[r]):
                cmd = streams[r][pc[r]]
                c, b = cmd.kwargs.get("chunk", 0), getattr(cmd, "buffer_id", None)
                vs = stage_of(r, c, p)
                if isinstance(cmd, (sch.RecvActivation, sch.RecvGrad)):
                    kind = "act" if isinstance(cmd, sch.RecvActivation) else "grad"
                    q = links.setdefault((kind, r, c), deque())
                    if not q:
                        break
                    assert q.popleft() == b
                elif isinstance(cmd, (sch.SendActivation, sch.SendGrad)):
                    act = isinstance(cmd, sch.SendActivation)
                    dst = holder(vs + 1 if act else vs - 1, p)
                    assert dst[0] != r, "a message between neighbours on one rank"
                    links.setdefault(("act" if act else "grad", *dst), deque()).append(b)
                elif isinstance(cmd, sch.BackwardWeightPass):
                    assert ("B", vs, b) in ran, "W before its B"
                    done[r].append(("W", c, b))
                elif isinstance(cmd, (sch.ForwardPass, sch.BackwardPass, sch.BackwardInputPass)):
                    k = type(cmd).__name__[0]
                    local = vs - 1 if k == "F" else vs + 1  # a neighbour it depends on
                    if 0 <= local < 2 * p and holder(local, p)[0] == r and v_layout:
                        assert (k, local, b) in ran, f"{k}{c} of {b} before the turn"
                    if k == "B":
                        assert ("F", vs, b) in ran
                    ran.add((k, vs, b))
                    done[r].append((k, c, b))
                pc[r] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock: p={p} at {pc}")
    return done


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_interleaved_schedule(p: int, v: int, groups: int) -> None:
    m = p * groups
    streams = [
        [c for st in sch.InterleavedTrainSchedule(m, p, r, v).steps() for c in st] for r in range(p)
    ]
    done = simulate_chunks(streams, p)
    for r in range(p):
        for kind in "FB":
            seen = sorted((c, b) for k, c, b in done[r] if k == kind)
            assert seen == [(c, b) for c in range(v) for b in range(m)]  # each once
    # rank 0 warms up with (p-1)*2 + (v-1)*p forwards (Megatron's), then goes 1F1B
    warmup = min((p - 1) * 2 + (v - 1) * p, m * v)
    first = [k for k, _, _ in done[0]].index("B")
    assert first == (warmup + 1 if warmup < m * v else m * v)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_interleaved_inference(p: int, m: int) -> None:
    streams = [
        [c for st in sch.InferenceSchedule(m, p, r, 2).steps() for c in st] for r in range(p)
    ]
    done = simulate_chunks(streams, p)
    for r in range(p):
        assert sorted(x[1:] for x in done[r]) == [(c, b) for c in range(2) for b in range(m)]


def test_interleaved_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match="not a multiple of 4; use 8"):
        sch.InterleavedTrainSchedule(6, 4, 0, 2)


def test_upstreams_schedule_names() -> None:
    """Upstream's read-only properties, and its one-stage DataParallelSchedule."""
    from deepspeed.runtime.pipe.schedule import DataParallelSchedule

    s = sch.TrainSchedule(micro_batches=4, stages=3, stage_id=1)
    assert (s.stage, s.num_stages, s.num_micro_batches) == (1, 3, 4)
    steps = list(DataParallelSchedule(micro_batches=2, stages=1, stage_id=0))
    mb = [sch.LoadMicroBatch(0), sch.ForwardPass(0), sch.BackwardPass(0)]
    assert steps == [mb, mb, [sch.ReduceGrads(), sch.OptimizerStep()]]
    with pytest.raises(ValueError, match="one stage"):
        list(DataParallelSchedule(micro_batches=2, stages=2, stage_id=0))


def _v_streams(
    m: int, p: int, forward_only: bool = False, split: bool = False
) -> list[list[sch.PipeInstruction]]:
    return [
        [c for st in sch.DualPipeVSchedule(m, p, r, forward_only, split).steps() for c in st]
        for r in range(p)
    ]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
@pytest.mark.parametrize("split", [False, True])
def test_dualpipev_schedule(p: int, extra: int, split: bool) -> None:
    m = 2 * p + extra
    streams = _v_streams(m, p, split=split)
    done = simulate_chunks(streams, p, v_layout=True)
    for r in range(p):
        kinds = [k for k, _, _ in done[r]]
        if split:  # each W right after its B (and the B's send)
            assert [kinds[i + 1] for i, k in enumerate(kinds) if k == "B"] == ["W"] * 2 * m
            assert not any(isinstance(cmd, sch.BackwardPass) for cmd in streams[r])
        else:
            assert "W" not in kinds
        for kind in "FB" + ("W" if split else ""):
            for c in (0, 1):
                assert [b for k, cc, b in done[r] if (k, cc) == (kind, c)] == list(range(m))
        loads = [cmd.kwargs["chunk"] for cmd in streams[r] if isinstance(cmd, sch.LoadMicroBatch)]
        assert sorted(loads) == (sorted([0, 1] * m) if r == 0 else [])  # rank 0 alone reads
        assert streams[r][-3:] == [sch.ReduceTiedGrads(), sch.ReduceGrads(), sch.OptimizerStep()]
    if p > 1:  # rank 0 warms up with 2(p-1) chunk-0 forwards, then one of each chunk
        assert [k + str(c) for k, c, _ in done[0][: 2 * p]] == ["F0"] * (2 * p - 1) + ["F1"]


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_dualpipev_forward_only(p: int, m: int) -> None:
    streams = _v_streams(m, p, forward_only=True)
    done = simulate_chunks(streams, p, v_layout=True)
    for r in range(p):
        assert sorted(done[r]) == sorted(("F", c, b) for c in (0, 1) for b in range(m))
        assert not any(isinstance(cmd, sch.OptimizerStep) for cmd in streams[r])


def test_dualpipev_needs_two_micro_batches_per_stage_to_train() -> None:
    with pytest.raises(ValueError, match="at least 2 \\* stages = 8 micro-batches a batch, not 7"):
        sch.DualPipeVSchedule(7, 4, 0)
    sch.DualPipeVSchedule(7, 4, 0, forward_only=True)


@pytest.mark.parametrize("m", [8, 16, 32])
def test_dualpipev_idles_less_than_1f1b_on_the_same_ranks(m: int) -> None:
    """Each rank does the same work either way (two half-size stages or one whole one):
    DualPipeV, filling the pipe from both ends, idles less than 1F1B's 3(p-1) per rank."""
    p = 4
    one_f_one_b = timed([sch.TrainSchedule(m, p, s).order() for s in range(p)], {"F": 2, "B": 4})
    orders = [sch.DualPipeVSchedule(m, p, r).order() for r in range(p)]
    v = timed(orders, {"F": 1, "B": 2}, v_layout=True)
    assert one_f_one_b - 6 * m == 6 * (p - 1)
    assert v - 6 * m == 11  # against 18
    # split (dualpipev-zb): B and W of one unit each, W after B's send: 6, ZB-H1's (p-1)*F
    orders = []
    for r in range(p):
        order = []
        for kind, c, mb in sch.DualPipeVSchedule(m, p, r, split_backward=True).order():
            order += [(kind, c, mb)] + ([("W", c, mb)] if kind == "B" else [])
        orders.append(order)
    assert timed(orders, {"F": 1, "B": 1, "W": 1}, v_layout=True) - 6 * m == 2 * (p - 1)
