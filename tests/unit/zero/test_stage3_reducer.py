"""Stage3Reducer in one process: W ranks simulated by a scatter that sums W identical
buckets, so each partition must come out as exactly this rank's shard of the gradient
([Note: stage-3 gradient reduction]): pooled buckets reused (stale values in their padding),
rows closed up for a part-filled bucket, a parameter larger than a bucket, accumulation over
two backward passes, and no full gradient kept past its hook."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from deepspeed_ext.comm.layout import AxisGroup
from deepspeed_ext.zero.stage3.reduce import Stage3Reducer, _Bucket, fill_shards

W, RANK = 3, 2  # the last rank: its shards hold the padding


class _Done:
    def wait(self) -> None:
        pass


def scatter_of_identical_ranks(out: torch.Tensor, bucket: torch.Tensor, group: AxisGroup):
    """The sum over W ranks that all hold `bucket`: W times this rank's chunk."""
    chunk = bucket.numel() // group.size
    out.copy_(bucket[group.rank * chunk : (group.rank + 1) * chunk] * group.size)
    return _Done()


def param(numel: int) -> SimpleNamespace:
    shard = -(-numel // W)
    return SimpleNamespace(numel=numel, ds_shard_numel=shard, ds_device=torch.device("cpu"))


def own_shard(grad: torch.Tensor, shard: int) -> torch.Tensor:
    padded = torch.zeros(W * shard)
    padded[: grad.numel()] = grad.reshape(-1)
    return padded[RANK * shard : (RANK + 1) * shard]


def reducer(params: list, bucket_numel: int, **kw) -> Stage3Reducer:
    """This rank's fp32 reducer on CPU over W simulated ranks whose buckets are identical."""
    group = AxisGroup(None, tuple(range(W)), RANK)
    return Stage3Reducer(
        params,
        torch.float32,
        torch.device("cpu"),
        bucket_numel,
        group,
        scatter=scatter_of_identical_ranks,
        **kw,
    )


def test_fill_shards_zeroes_the_padding_and_close_up_packs_rows():
    buf = torch.full((W * 4,), 7.0)
    b = _Bucket(buf, 4, pooled=True)
    fill_shards(b.rows(W)[:, 0:2], torch.arange(5.0))  # 5 elements as 3 shards of 2
    b.used = 2
    assert b.rows(W)[:, :2].tolist() == [[0, 1], [2, 3], [4, 0]]
    assert b.close_up(W).tolist() == [0, 1, 2, 3, 4, 0]


@pytest.mark.parametrize("bucket_numel", [30, 12, 60, 10**9])
def test_partitions_are_this_ranks_shards_through_pooled_buckets(bucket_numel):
    """Part-filled buckets (rows closed up) at 30, 12 and 60; one full bucket at 10**9."""
    params = [param(n) for n in (7, 5, 40, 1, 9, 9, 3)]  # 40 > any bucket of 30 / 12
    red = reducer(params, bucket_numel, max_in_flight=1)
    gen = torch.Generator().manual_seed(0)
    want = {id(p): torch.zeros(p.ds_shard_numel) for p in params}
    for _ in range(2):  # a second backward reuses buffers that hold the first one's values
        for p in reversed(params):  # the order hooks fire in: last layer first
            g = torch.randn(p.numel, generator=gen)
            want[id(p)] += own_shard(g, p.ds_shard_numel)  # W ranks summed, then / W
            red.add(p, g)
        red.flush()
    for p in params:
        torch.testing.assert_close(red.part[id(p)], want[id(p)], rtol=0, atol=1e-6)
    assert red.made == 0 and not red.pool  # the pool is freed when backward ends


def test_no_full_gradient_is_kept_past_its_hook():
    params = [param(600) for _ in range(4)]
    red = reducer(params, 10**9)
    refs = []
    for p in params:
        g = torch.randn(p.numel)
        refs.append(weakref.ref(g))
        red.add(p, g)
        del g
    gc.collect()
    assert all(r() is None for r in refs), "a gradient outlived its copy into the bucket"
    red.flush()


def test_partitions_are_made_by_backward_and_freed_by_zero():
    """No gradient partition sits beside the next forward's activations: none exists before
    a reduction reaches it, zero() drops them all, and one nothing reached reads as zeros."""
    params = [param(n) for n in (6, 9, 4)]
    red = reducer(params, 12)
    assert red.grads() == []
    for step in range(2):
        g0, g1 = torch.randn(6), torch.randn(9)
        red.add(params[0], g0.clone())  # add() may reduce a gradient in place: the hook's
        red.add(params[1], g1.clone())  # caller drops it
        red.flush()
        assert sorted(red.part) == sorted([id(params[0]), id(params[1])])
        torch.testing.assert_close(red.part_of(params[0]), own_shard(g0, 2), rtol=0, atol=1e-6)
        torch.testing.assert_close(red.part_of(params[1]), own_shard(g1, 3), rtol=0, atol=1e-6)
        assert red.part_of(params[2]).tolist() == [0.0, 0.0]  # unused this step: zeros
        red.zero()
        assert red.grads() == [], f"step {step}: partitions kept past zero()"


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_pooled_buckets_share_reduce_bucket_size(in_flight):
    """The bucket being filled and those being reduced hold reduce_bucket_size elements
    between them: overlap_comm (buckets in flight) costs no memory over reducing each at once."""
    params = [param(6) for _ in range(12)]
    red = reducer(params, 36, max_in_flight=in_flight)
    most = 0
    for p in params:
        red.add(p, torch.randn(p.numel))
        most = max(most, red.made)
    assert most == in_flight + 1  # every pooled buffer was used
    assert most * W * red.cap <= 36
    red.flush()
