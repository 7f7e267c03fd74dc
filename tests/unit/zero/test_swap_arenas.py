"""[Note: sub-group arenas]: optimizer sub-groups read into reused page-aligned memory, and a
value handed over from that memory outliving its reuse only as a copy."""

from types import SimpleNamespace

import pytest
import torch

from deepspeed_ext.zero.offload import NVMeSwapper
from deepspeed_ext.zero.stage3.nvme import ParamSwap
from deepspeed_ext.zero.stage3.swap_arenas import ALIGN, SwapArenas


@pytest.fixture
def swapper(tmp_path):
    s = NVMeSwapper(str(tmp_path), rank=0, tag="arenas")
    yield s
    s.close()


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_views_are_aligned_apart_and_reused(swapper):
    arenas = SwapArenas(swapper)
    shapes = [(1000, torch.float32), (3, torch.bfloat16), (5000, torch.float32)]
    arena, views = arenas.carve(shapes)
    assert [(v.numel(), v.dtype) for v in views] == shapes
    spans = sorted(_span(v) for v in views)
    assert all(lo % ALIGN == 0 for lo, _ in spans)
    assert all(a_hi <= b_lo for (_, a_hi), (b_lo, _) in zip(spans, spans[1:]))  # apart
    lo, hi = _span(arena)
    assert all(lo <= a and b <= hi for a, b in spans)  # inside their arena
    arenas.give(arena)
    again, _ = arenas.carve([(10, torch.float32)])  # a smaller group: the same memory
    assert again.data_ptr() == arena.data_ptr()
    arenas.give(again)
    bigger, _ = arenas.carve([(50_000, torch.float32)])  # does not fit: a new, larger one
    assert bigger.data_ptr() != arena.data_ptr()
    assert arenas.stats == {"arenas_made": 2, "arenas_reused": 1}
    arenas.give(bigger)
    arenas.release_spare()
    fresh, _ = arenas.carve([(10, torch.float32)])
    assert arenas.stats["arenas_made"] == 3  # nothing spare after release_spare


def test_exact_arenas_fit_their_group_alone(swapper):
    """A new arena is made as large as the largest since release_spare(), so that later
    sub-groups of a step fit it; the persistent parameters' step beside sub-groups read
    early for the forward asks for just its own size."""
    arenas = SwapArenas(swapper)
    big, _ = arenas.carve([(100_000, torch.float32)])
    small, _ = arenas.carve([(10, torch.float32)])
    assert small.numel() == big.numel()  # sized for the next sub-groups of the step
    tiny, _ = arenas.carve([(10, torch.float32)], exact=True)
    assert tiny.numel() == ALIGN
    arenas.give(tiny)
    again, _ = arenas.carve([(5, torch.float32)])  # a spare that fits is reused as before
    assert again.data_ptr() == tiny.data_ptr()


def test_spare_arenas_are_bounded(swapper):
    arenas = SwapArenas(swapper)
    held = [arenas.carve([(1024 * (k + 1), torch.float32)])[0] for k in range(6)]
    for a in held:
        arenas.give(a)
    assert len(arenas._spare) == 3  # the smallest went back to the allocator


def _param(numel: int) -> SimpleNamespace:
    return SimpleNamespace(
        ds_id=7,
        ds_shard_numel=numel,
        dtype=torch.float32,
        ds_tensor=torch.full((numel,), 1.0),
        ds_step_pending=None,
        ds_swap=None,
    )


def test_value_handed_over_outlives_its_memory_only_when_counted_on(swapper):
    """A read-ahead that counted on a handed-over value gets it even after the arena it
    lives in is reused (forget copies it); one nobody counted on is read from the file."""
    swap = ParamSwap(swapper)
    p, q = _param(64), _param(64)
    q.ds_id = 8
    swap.attach(p)
    swap.attach(q)
    memory = torch.full((128,), 2.0)
    swap.hand_over(p, memory[:64])
    swap.hand_over(q, memory[64:])
    assert swap.read_ahead(p)  # counts on the value in memory
    swap.forget(p)
    swap.forget(q)
    memory.fill_(3.0)  # the arena serves the next sub-group
    assert torch.equal(swap.fetch(p), torch.full((64,), 2.0))
    assert torch.equal(swap.fetch(q), torch.full((64,), 1.0))  # its file: nothing pending


def test_master_read_early_serves_its_shard_until_its_memory_goes(swapper):
    """[Note: one file for a shard and its master]: a shard whose master is being read into
    memory is gathered from there (after that read completes), as often as asked, and a
    read-ahead needs no buffer for it; once the master's memory goes, a read-ahead that
    counted on it keeps a copy, and later fetches read the file."""
    swap = ParamSwap(swapper)
    p = _param(64)
    swap.attach(p)  # the file holds 1.0
    memory = torch.full((64,), 2.0)  # stands for the master read (its own bytes, to tell)
    waited = []
    swap.mirror(p, memory, lambda: waited.append(1))
    assert swap.fetch(p) is memory and waited == [1]
    assert swap.fetch(p) is memory  # a recompute gathers it again: still from memory
    assert swap.read_ahead(p)  # no pool at all: nothing to read
    swap.unmirror(p)  # the arena goes while that read-ahead counts on it
    memory.fill_(3.0)
    assert torch.equal(swap.fetch(p), torch.full((64,), 2.0))
    assert torch.equal(swap.fetch(p), torch.full((64,), 1.0))
    assert swap.stats["fetched_mirror"] == 2 and swap.stats["fetched_cold"] == 1
    swap.mirror(p, memory, lambda: None)
    swap.stale(p)  # the file is about to change: the memory no longer holds it
    assert torch.equal(swap.fetch(p), torch.full((64,), 1.0))


def test_read_group_failing_part_way_gives_its_arena_back(swapper):
    """A submit that fails in the middle of a sub-group: the reads queued before it end,
    every master of the group is back to its placeholder, its arena is spare again, and
    the next read of the group works."""
    from deepspeed_ext.zero.stage3.nvme import OptimizerSwap

    values = [torch.randn(300), torch.randn(500)]
    masters = [torch.nn.Parameter(v.clone()) for v in values]
    params = [SimpleNamespace(ds_shard_numel=300, ds_swap=None), _param(500)]
    swap = OptimizerSwap(swapper, sub_group_numel=10_000)
    swap.attach(torch.optim.AdamW(masters), params, masters)
    real, calls = swapper.swap_in, []

    def failing(key, out, **kw):
        calls.append(key)
        if len(calls) == 2:
            raise OSError(f"submit of {key} failed")
        return real(key, out, **kw)

    swapper.swap_in = failing
    with pytest.raises(OSError, match="master1"):
        swap.read_group([0, 1])
    swapper.swap_in = real
    assert [m.numel() for m in masters] == [0, 0]
    assert not swap._arena_of and len(swap.arenas._spare) == 1
    swap.read_group([0, 1])
    swap.wait_group([0, 1])
    assert all(torch.equal(m.data, v) for m, v in zip(masters, values))
    assert swap.arenas.stats == {"arenas_made": 1, "arenas_reused": 1}


def test_a_master_changed_in_memory_is_never_gathered_as_its_shard(swapper):
    """The masters' step changes their memory before it writes their files: a shard that
    shares its master's file stops being served from that memory first, so a step that
    fails part way leaves gathers reading the file; and a shard already read ahead into a
    pool buffer keeps that buffer instead of a mirror."""
    from deepspeed_ext.zero.stage3.nvme import OptimizerSwap, ShardPool

    values = torch.randn(64)
    master = torch.nn.Parameter(values.clone())
    p = _param(64)
    p.ds_tensor = values.clone()
    shards = ParamSwap(swapper)
    shards.attach(p)

    class Failing(torch.optim.SGD):
        def step(self, closure: object = None) -> None:
            master.data.add_(1.0)
            raise RuntimeError("the step failed")

    swap = OptimizerSwap(swapper, sub_group_numel=10_000)
    swap.attach(Failing([master], lr=0.1), [p], [master])  # p's shard lives in master0's file
    assert shards.shares(p)
    swap.read_group([0])
    swap.mirror_shards([0])
    assert shards.fetch(p).data_ptr() == master.data_ptr()  # served from the memory
    with pytest.raises(RuntimeError, match="the step failed"):
        swap.step_and_write([0], [], lambda i: torch.zeros(64))
    assert torch.equal(shards.fetch(p), values)  # the file's, not the memory's values + 1
    swap.drop_group([0])

    p.element_size = lambda: 4  # fp32
    pool = ShardPool(swapper, 1, 64)
    pool.size_for([p])
    ahead = ParamSwap(swapper, pool)
    ahead.share(p, swapper, "master0")
    assert ahead.read_ahead(p)  # into the pool buffer
    ahead.mirror(p, torch.full((64,), 5.0), lambda: None)
    assert torch.equal(ahead.fetch(p), values) and ahead.stats["fetched_ahead"] == 1
    ahead.release(p)
    assert pool._free == [0]
