"""ZeRO-Infinity's NVMe tier for stage 3: parameter shards and optimizer state on files.

[Note: stage-3 NVMe offload]
- offload_param {device: nvme}: each rank's shard of a non-persistent parameter lives in a
  swap file once the first max_in_cpu elements of shards stay in CPU memory; `ds_tensor` is
  then an empty placeholder and `ds_swap` reads the shard back for a gather (read_shard) or
  writes a new one after the optimizer step (write_shard).
- offload_optimizer {device: nvme}: the fp32 master shards and their optimizer state (Adam's
  m and v) live in swap files between steps. The step runs in sub-groups of at most
  sub_group_size elements: swap a sub-group in, step only its parameters, write the new
  values into the parameter shards, swap it out; CPU memory holds one sub-group's states at
  a time (the gradients stay in CPU memory). With offload_optimizer.step_in_backward the
  sub-groups step during the backward instead ([Note: optimizer steps in backward]).
- both on NVMe with an fp32 model: a trainable parameter's shard and its fp32 master are the
  same bytes, so the shard lives in the master's file ([Note: one file for a shard and its
  master]).
Swap files are named by ds_id and master index, under <nvme_path>/zero_stage_3/<tag>/rank<r>.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.offload.nvme import NVMeSwapper

from .param import write_shard
from .swap_arenas import SwapArenas


class ShardPool:
    """offload_param's buffer_count buffers of at most buffer_size elements: page-aligned,
    locked host memory the read-ahead reads shards into, reused across steps. A buffer is
    allocated at its first use, sized to the largest swapped shard (not to buffer_size,
    which only caps it)."""

    def __init__(self, swapper: NVMeSwapper, count: int, numel: int) -> None:
        self.swapper, self.count, self.numel = swapper, count, numel
        self._bufs: list[torch.Tensor] = []  # uint8, allocated lazily
        self._free: list[int] = []
        self.nbytes = 0  # bytes per buffer, set by size_for()

    def size_for(self, shards: list[Any]) -> None:
        self.nbytes = max((p.ds_shard_numel * p.element_size() for p in shards), default=0)

    def take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if len(self._bufs) < self.count and self.nbytes:
            handle = self.swapper._handle
            align = handle.get_alignment()
            size = -(-self.nbytes // align) * align
            self._bufs.append(handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8)))
            return len(self._bufs) - 1
        return None

    def view(self, i: int, p: Any) -> torch.Tensor:
        n = p.ds_shard_numel * p.element_size()
        return self._bufs[i][:n].view(p.dtype)

    def give(self, i: int) -> None:
        self._free.append(i)


class ParamSwap:
    """A parameter shard's home on NVMe (see [Note: stage-3 NVMe offload]). With a pool,
    read_ahead() starts reading shards the gathers will want next, so the reads overlap
    compute; fetch() then hands out the pool buffer, which release() returns."""

    def __init__(self, swapper: NVMeSwapper, pool: ShardPool | None = None) -> None:
        self.swapper = swapper
        self.pool = pool
        self._ahead: dict[int, int] = {}  # id(param) -> pool buffer being read into
        self._lent: dict[int, int] = {}  # id(param) -> pool buffer fetch() handed out
        # id(param) -> (swapper, key) of a file another owner keeps: the master's
        self._homes: dict[int, tuple[NVMeSwapper, str]] = {}
        # id(param) -> its new value in memory while the file is being written
        self._fresh: dict[int, torch.Tensor] = {}
        self._claimed: set[int] = set()  # fresh values a read-ahead counted on: kept for fetch
        # id(param) -> its file's bytes being read into memory by another owner (a master
        # read early), and the call that completes that read
        self._mirrors: dict[int, tuple[torch.Tensor, Callable[[], None]]] = {}
        self.stats = {
            "read_ahead": 0,
            "fetched_ahead": 0,
            "fetched_cold": 0,
            "fetched_fresh": 0,
            "fetched_mirror": 0,
        }

    @staticmethod
    def _key(p: Any) -> str:
        return f"param{p.ds_id}"

    def _home(self, p: Any) -> tuple[NVMeSwapper, str]:
        return self._homes.get(id(p)) or (self.swapper, self._key(p))

    def share(self, p: Any, swapper: NVMeSwapper, key: str) -> None:
        """[Note: one file for a shard and its master]
        With both offloads on NVMe and an fp32 model, the optimizer's fp32 master of a
        trainable parameter is its shard, byte for byte, and the optimizer writes it after
        every step: p's shard is read from that file, and p's own file goes. The step then
        writes each shard once instead of twice (no synchronous shard write after the
        master's) and the disk holds it once. `swapper` orders a read after the write of
        the same key, so a gather never reads a master being written."""
        self.stale(p)
        self.swapper.discard(self._key(p))
        self._homes[id(p)] = (swapper, key)

    def shares(self, p: Any) -> bool:
        return id(p) in self._homes

    def hand_over(self, p: Any, value: torch.Tensor) -> None:
        """p's new value, in memory while its file (shared: [Note: one file for a shard and
        its master]) is written: a fetch takes it instead of waiting for the write to end.
        The owner calls forget() once the write is done; a value read_ahead() counted on
        stays until fetched (as a read-ahead buffer would)."""
        self.stale(p)
        self._fresh[id(p)] = value

    def forget(self, p: Any) -> None:
        """The memory of the value handed over is about to be reused ([Note: sub-group
        arenas]): dropped, or copied when a read-ahead counted on it."""
        fresh = self._fresh.get(id(p))
        if fresh is None:
            return
        if id(p) in self._claimed:
            self._fresh[id(p)] = fresh.clone()
        else:
            del self._fresh[id(p)]

    def mirror(self, p: Any, value: torch.Tensor, wait: Callable[[], None]) -> None:
        """p's file (shared: [Note: one file for a shard and its master]) is being read into
        `value` by its owner, which keeps it unchanged until stale(p) or unmirror(p): a
        gather takes the shard from there once wait() returns, instead of reading the file
        again, and a read-ahead needs no buffer for it."""
        if id(p) not in self._ahead and id(p) not in self._lent:  # else read already
            self._mirrors[id(p)] = (value, wait)

    def unmirror(self, p: Any) -> None:
        """The memory given to mirror() is about to go: copied when a read-ahead counted
        on it."""
        entry = self._mirrors.pop(id(p), None)
        if entry is not None and id(p) in self._claimed:
            value, wait = entry
            wait()
            self._fresh[id(p)] = value.clone()

    def stale(self, p: Any) -> None:
        """p's file is about to change: a read-ahead of the old value is dropped."""
        self._fresh.pop(id(p), None)
        self._mirrors.pop(id(p), None)
        self._claimed.discard(id(p))
        i = self._ahead.pop(id(p), None)
        if i is not None and self.pool is not None:
            swapper, key = self._home(p)
            swapper.wait_read(key)
            self.pool.give(i)

    def attach(self, p: Any) -> None:
        self.swapper.swap_out(self._key(p), p.ds_tensor)
        p.ds_tensor = torch.empty(0, dtype=p.ds_tensor.dtype)
        p.ds_swap = self

    def read_ahead(self, p: Any) -> bool:
        """Start reading p's shard into a pool buffer; False when no buffer is free."""
        if id(p) in self._ahead or id(p) in self._lent:
            return True
        if p.ds_step_pending is not None:
            # [Note: optimizer steps in forward]: the file holds the value before the
            # pending update, and the step at its gather hands the new one over from memory
            return False
        if id(p) in self._fresh or id(p) in self._mirrors:
            self._claimed.add(id(p))
            return True
        i = self.pool.take() if self.pool is not None else None
        if i is None:
            return False
        assert self.pool is not None
        swapper, key = self._home(p)
        swapper.swap_in(key, self.pool.view(i, p), async_op=True)
        self._ahead[id(p)] = i
        self.stats["read_ahead"] += 1
        return True

    def fetch(self, p: Any) -> torch.Tensor:
        fresh = self._fresh.pop(id(p), None)
        self._claimed.discard(id(p))
        if fresh is not None:  # the caller copies it (a gather's send buffer)
            self.stats["fetched_fresh"] += 1
            return fresh
        mirrored = self._mirrors.get(id(p))
        if mirrored is not None:  # stays until stale() or unmirror(): read again by a recompute
            value, wait = mirrored
            wait()
            self.stats["fetched_mirror"] += 1
            return value
        swapper, key = self._home(p)
        i = self._ahead.pop(id(p), None)
        if i is not None and self.pool is not None:
            swapper.wait_read(key)  # not the shards read ahead after it
            self._lent[id(p)] = i
            self.stats["fetched_ahead"] += 1
            return self.pool.view(i, p)
        out = torch.empty(p.ds_shard_numel, dtype=p.dtype)
        swapper.swap_in(key, out)
        self.stats["fetched_cold"] += 1
        return out

    def release(self, p: Any) -> None:
        """The caller of fetch() is done with the shard: its pool buffer may be reused."""
        i = self._lent.pop(id(p), None)
        if i is not None and self.pool is not None:
            self.pool.give(i)

    def store(self, p: Any, value: torch.Tensor) -> None:
        self.stale(p)
        swapper, key = self._home(p)
        swapper.swap_out(key, value.contiguous())


def offload_params(
    params: list[Any],
    swapper: NVMeSwapper,
    max_in_cpu: int,
    buffer_count: int = 0,
    buffer_size: int = 0,
) -> int:
    """Swap out the shards past the first max_in_cpu elements; returns how many went.
    buffer_count > 0 gives the read-ahead a pool of that many buffers of at most
    buffer_size elements each (offload_param.buffer_count / buffer_size)."""
    moving, kept = [], 0
    for p in params:
        if p.ds_persist or p.ds_swap is not None:
            continue
        if kept + p.ds_shard_numel <= max_in_cpu:
            kept += p.ds_shard_numel
            continue
        moving.append(p)
    pool = None
    if buffer_count > 0 and moving:
        biggest = max(moving, key=lambda p: p.ds_shard_numel)
        if biggest.ds_shard_numel > buffer_size:
            n = biggest.ds_shard_numel
            raise ValueError(
                f"zero_optimization.offload_param.buffer_size={buffer_size} elements is "
                f"smaller than the largest parameter shard swapped to NVMe ({n} elements): "
                f"raise it to at least {n}"
            )
        pool = ShardPool(swapper, buffer_count, buffer_size)
        pool.size_for(moving)
    swap = ParamSwap(swapper, pool)
    for p in moving:
        swap.attach(p)
    return len(moving)


def early_sub_group_numel(
    key: str, when: str, total: int, numel: int, given: bool, strict: bool = True
) -> int:
    """Sub-group size for offload_optimizer.{key} (steps outside engine.step()), which needs
    several sub-groups of the `total` master elements it moves on this rank: sub_group_size
    (`numel`) when below it; else an eighth of them when sub_group_size was not `given` (its
    default is one sub-group of everything) or the key is on by default (not `strict`:
    sub_group_size is then an upper bound); else an error naming the key and the fix."""
    full = f"zero_optimization.offload_optimizer.{key}"
    if not total:
        raise ValueError(
            f"{full} has nothing to move: every trainable parameter stays gathered (under "
            "stage3_param_persistence_threshold, or kept whole), and those step in "
            f"engine.step(): lower the threshold or remove {key}"
        )
    if numel < total:
        return numel
    size = max(1, total // 8)
    if not given or not strict:
        why = (
            "sub_group_size is not set"
            if not given
            else f"sub_group_size {numel} would hold all {total} of this rank's masters"
        )
        logger.info(
            f"{full}: {why}, so the optimizer steps in sub-groups of {size} elements (an "
            "eighth of this rank's masters); set sub_group_size below that total to choose"
        )
        return size
    raise ValueError(
        f"{full} steps sub-groups of zero_optimization.sub_group_size={numel} elements "
        f"{when}, but this rank's masters hold {total} in all, so they would all step at "
        f"once: set sub_group_size to about {size} (an eighth of them) or remove {key}"
    )


def _file(master: int, state: str = "") -> str:
    """The swapper's key of a master (or of one of its optimizer states)."""
    return f"master{master}.{state}" if state else f"master{master}"


class OptimizerSwap:
    """Masters and their optimizer state on NVMe, stepped in sub-groups.

    [Note: pipelined optimizer swap]
    offload_optimizer.pipeline_read reads sub-group k+1 from its files while sub-group k
    steps; pipeline_write writes sub-group k while k+1 steps (the swapper reads and writes
    on handles of their own, so each kind is waited for alone). Without them each sub-group
    is read, stepped and written in turn. Pipelining keeps up to three sub-groups in memory
    instead of one, and needs several sub-groups to overlap anything: zero_optimization's
    sub_group_size sets their size (elements of masters per sub-group)."""

    def __init__(
        self,
        swapper: NVMeSwapper,
        sub_group_numel: int,
        pipeline_read: bool = False,
        pipeline_write: bool = False,
    ) -> None:
        self.swapper = swapper
        self.sub_group_numel = max(1, sub_group_numel)
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        # sub-groups read while another stepped, written while another stepped
        self.stats = {"overlapped_reads": 0, "overlapped_writes": 0}
        self.masters: list[torch.Tensor] = []
        self.params: list[Any] = []  # the model parameter of each master
        self.index: dict[int, int] = {}  # id(parameter) -> its master's index
        self.arenas = SwapArenas(swapper)
        self._arena_of: dict[int, torch.Tensor] = {}  # master index -> arena it is read into

    def attach(self, optimizer: Any, params: list[Any], masters: list[torch.Tensor]) -> None:
        self.optimizer, self.params, self.masters = optimizer, params, masters
        self.index = {id(p): i for i, p in enumerate(params)}
        for i, m in enumerate(masters):
            p, numel = params[i], m.numel()
            self.swapper.swap_out(_file(i), m.data)
            m.data = torch.empty(0, dtype=m.dtype)
            swap = getattr(p, "ds_swap", None)
            if swap is not None and p.dtype == m.dtype and p.ds_shard_numel == numel:
                swap.share(p, self.swapper, _file(i))  # [Note: one file for a shard ...]

    def shared_swap(self, i: int) -> ParamSwap | None:
        """The ParamSwap of master i's parameter when the shard's file is the master's
        ([Note: one file for a shard and its master]), else None."""
        swap = getattr(self.params[i], "ds_swap", None)
        return swap if swap is not None and swap.shares(self.params[i]) else None

    def _store_shard(self, i: int) -> None:
        """The stepped master's value into its parameter's shard: nothing to do when the
        shard's file is the master's (made stale before the step), which the step writes
        next."""
        if self.shared_swap(i) is None:
            write_shard(self.params[i], self.masters[i].data)

    # -- moving one master and its state --
    def _state_tensors(self, m: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.optimizer.state.get(m, {})
        return {k: v for k, v in st.items() if torch.is_tensor(v) and k != "step" and v.dim()}

    def _swap_out(self, i: int) -> None:
        m = self.masters[i]
        self.swapper.swap_out(_file(i), m.data, async_op=True)
        for k, v in self._state_tensors(m).items():
            self.swapper.swap_out(_file(i, k), v, async_op=True)

    def _drop(self, i: int) -> None:
        """Master i and its states leave memory (placeholders keep their dtypes)."""
        m = self.masters[i]
        swap = getattr(self.params[i], "ds_swap", None)
        if swap is not None:
            swap.unmirror(self.params[i])
        for k, v in self._state_tensors(m).items():
            self.optimizer.state[m][k] = torch.empty(0, dtype=v.dtype)
        m.data = torch.empty(0, dtype=m.dtype)

    def _sub_groups(self, skip: frozenset[int] = frozenset()) -> Iterator[list[int]]:
        group: list[int] = []
        size = 0
        for i, p in enumerate(self.params):
            if i in skip:
                continue
            if group and size + p.ds_shard_numel > self.sub_group_numel:
                yield group
                group, size = [], 0
            group.append(i)
            size += p.ds_shard_numel
        if group:
            yield group

    # -- the step --
    def read_group(self, sub: list[int], background: bool = False, exact: bool = False) -> None:
        """Starts reading the masters of `sub` and their states into one arena ([Note:
        sub-group arenas]; async: wait_group, or wait_reads() with the same `background`;
        exact: as SwapArenas.carve)."""
        shapes: list[tuple[int, torch.dtype]] = []
        keys: list[tuple[int, str]] = []  # (master, state key; "" for the master itself)
        for i in sub:
            m, numel = self.masters[i], self.params[i].ds_shard_numel
            shapes.append((numel, m.dtype))
            keys.append((i, ""))
            for k, v in self._state_tensors(m).items():
                shapes.append((numel, v.dtype))
                keys.append((i, k))
        arena, views = self.arenas.carve(shapes, exact)
        for i in sub:
            self._arena_of[i] = arena
        queued = 0
        try:
            for (i, k), view in zip(keys, views):
                m = self.masters[i]
                if k:
                    self.optimizer.state[m][k] = view
                else:
                    m.data = view
                self.swapper.swap_in(_file(i, k), view, async_op=True, background=background)
                queued += 1
        except BaseException:
            # none of `sub` counts as read (the callers record it once submitted): the
            # reads queued before the failure end, and the arena goes back
            for i, k in keys[:queued]:
                try:
                    self.swapper.wait_read(_file(i, k))
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            self.drop_group(sub)
            raise

    def mirror_shards(self, sub: list[int]) -> None:
        """`sub` is being read (read_group) and stays unchanged until it steps or is
        dropped: the parameter shards whose file is their master's ([Note: one file for a
        shard and its master]) are gathered from it instead of read from the file again."""
        for i in sub:
            swap = self.shared_swap(i)
            if swap is not None:
                wait = functools.partial(self.swapper.wait_read, _file(i))
                swap.mirror(self.params[i], self.masters[i].data, wait)

    @torch.no_grad()
    def _step_only(
        self,
        sub: list[int],
        grad_of: Callable[[int], torch.Tensor],
        hyper: list[dict[str, Any]] | None = None,
    ) -> None:
        """optimizer.step() on the masters of `sub` alone (in memory), master i getting
        grad_of(i) (a master's grad must match its size, so it is attached once swapped in);
        their new values go to the shards. The caller swaps them out. `hyper` (one dict per
        param group) stands in for the groups' hyperparameters during this step: those of an
        engine.step() whose update runs later ([Note: optimizer steps in forward])."""
        opt = self.optimizer
        all_params = [list(g["params"]) for g in opt.param_groups]
        for i in sub:
            swap = self.shared_swap(i)
            if swap is not None:  # its file's bytes change in memory from here (and if the
                swap.stale(self.params[i])  # step fails part way, the file is what holds)
            self.masters[i].grad = grad_of(i)
        chosen = {id(self.masters[i]) for i in sub}
        saved = [{k: g[k] for k in h if k in g} for g, h in zip(opt.param_groups, hyper or [])]
        try:
            for g, ps in zip(opt.param_groups, all_params):
                g["params"] = [m for m in ps if id(m) in chosen]
            for g, h in zip(opt.param_groups, hyper or []):
                g.update(h)
            opt.step()
        finally:
            for g, ps in zip(opt.param_groups, all_params):
                g["params"] = ps
            for g, h, old in zip(opt.param_groups, hyper or [], saved):
                # a value the step itself changed (a counter kept in the group) is kept
                g.update({k: v for k, v in old.items() if g.get(k) is h[k]})
        for i in sub:
            self.masters[i].grad = None
            self._store_shard(i)

    def step_and_write(
        self,
        sub: list[int],
        written: list[int],
        grad_of: Callable[[int], torch.Tensor],
        hyper: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Steps `sub` (in memory), then completes the writes of `written` (which overlapped
        the step) and frees them, and starts writing `sub`: returns what is being written."""
        self._step_only(sub, grad_of, hyper)
        self.swapper.wait_writes()
        self.drop_group(written)
        for i in sub:
            self._swap_out(i)
        return list(sub)

    def write_master(self, p: Any, value: torch.Tensor) -> None:
        """A new value of p's master (GatheredParameters changed p), into its file; nothing
        to do when that file is p's shard's, which write_shard has just written. Call with
        every master swapped out (no deferred step pending)."""
        i = self.index[id(p)]
        if self.shared_swap(i) is not None:
            return
        self.swapper.swap_out(_file(i), value.to(self.masters[i].dtype).contiguous())

    def wait_group(self, sub: list[int]) -> None:
        """Completes the reads of `sub` alone (read_group), not those queued after them."""
        for i in sub:
            self.swapper.wait_read(_file(i))
            for k in self._state_tensors(self.masters[i]):
                self.swapper.wait_read(_file(i, k))

    def end_writes(self, *groups: list[int]) -> None:
        """The last sub-groups of a step: their writes completed, they leave memory, and
        with them the spare arenas ([Note: sub-group arenas])."""
        self.swapper.wait_writes()
        for sub in groups:
            self.drop_group(sub)
        self.arenas.release_spare()

    def drop_group(self, sub: list[int]) -> None:
        """`sub` leaves memory (written back, or unchanged); its arena serves the next read
        once none of its masters is left in memory."""
        arenas = {}
        for i in sub:
            self._drop(i)
            arena = self._arena_of.pop(i, None)
            if arena is not None:
                arenas[id(arena)] = arena
        held = {id(a) for a in self._arena_of.values()}
        for key, arena in arenas.items():
            if key not in held:
                self.arenas.give(arena)

    @torch.no_grad()
    def step(
        self,
        grad_of: Callable[[int], torch.Tensor],
        skip: frozenset[int] = frozenset(),
        exact: bool = False,
    ) -> None:
        """Every master not in `skip` steps, one sub-group at a time (step_and_write); reads and
        writes overlap the steps as configured ([Note: pipelined optimizer swap]). exact: new
        arenas fit these sub-groups alone (SwapArenas.carve)."""
        sw = self.swapper
        subs = list(self._sub_groups(skip))
        written: list[int] = []  # stepped and being written, not yet dropped
        if subs:
            self.read_group(subs[0], exact=exact)
        for k, sub in enumerate(subs):
            sw.wait_reads()  # sub-group k is in memory
            if self.pipeline_read and k + 1 < len(subs):
                self.read_group(subs[k + 1], exact=exact)  # overlaps this step
                self.stats["overlapped_reads"] += 1
            if self.pipeline_write:  # the previous sub-group's write overlaps this step
                self.stats["overlapped_writes"] += bool(written)
            written = self.step_and_write(sub, written, grad_of)
            if not self.pipeline_write:
                sw.wait_writes()
                self.drop_group(written)
                written = []
            if not self.pipeline_read and k + 1 < len(subs):
                self.read_group(subs[k + 1], exact=exact)
        self.end_writes(written)

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Every master and state in memory (a checkpoint save or load); swapped out after."""
        # in the step's sub-groups: arenas of the sizes the steps use, which a caching
        # (pinned) host allocator then gives back to them
        subs = list(self._sub_groups())
        for sub in subs:
            self.read_group(sub)
        self.swapper.wait_reads()
        try:
            yield
        finally:
            for i in range(len(self.masters)):
                self._swap_out(i)
            self.end_writes(*subs)
