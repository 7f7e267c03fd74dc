"""The spawning helper itself: rank 0, which hosts the TCP store, stays until every rank is
done with it (a rank still making a side group after rank 0 returned failed with
'Connection reset by peer' in full-suite runs)."""

from __future__ import annotations

import time

from tests.helpers.distributed import run_ranks


def _late_group() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 has returned by now
        group = dist.new_group([1], backend="gloo")  # a rendezvous through rank 0's store
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        return int(t.item())
    return 0


def test_rank_zero_outlives_the_others_use_of_its_store() -> None:
    assert run_ranks(_late_group, 2, timeout=60) == [0, 1]
