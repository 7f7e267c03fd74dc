"""Optimizer steps deferred into the next forward, for optimizer state on NVMe.

[Note: optimizer steps in forward]
offload_optimizer.step_in_forward (a deepspeed_ext key; NVMe only; on by default there
unless step_in_backward is set, since the step after the backward is bound by the disk:
docs/benchmarks.md): engine.step() does what needs every gradient -- the global norm, the
overflow check, clipping, the loss-scale update -- and then, instead of reading, updating
and writing every sub-group of optimizer state while nothing else runs, leaves the updates
pending. A sub-group steps when one of its parameters' shards is first read (a gather or a
read-ahead: read_shard and ParamSwap look at `ds_step_pending`), so in the next forward each
sub-group steps just before its layers gather, and its state's reads and writes overlap
the compute of the layers before and after. Unlike [Note: optimizer steps in backward],
this works with gradient clipping, fp16 and overflow checks, which are all decided before
anything is deferred.
- Exact: each sub-group steps once with the gradients (already clipped and unscaled) and
  the hyperparameters of its engine.step(), snapshotted before the LR scheduler moves; the
  gradient partitions are kept (the reducer starts new ones) until their sub-group steps.
- One sub-group is read ahead, the next pending one in order after the last stepped; one is
  being written while the next steps: at most three in memory, as with pipelined swapping,
  which this path always does (offload_optimizer.pipeline_read / pipeline_write then only
  govern the persistent parameters' step in engine.step()).
- The first three sub-groups (in the forward's order) are read during the boundary backward
  before their step, once a fifth of the deferred masters' gradients are final
  (Stage3Strategy._reduced_early): the disk, busy with nearly all the optimizer's reads and
  writes in the forward, carries only parameter shards in the backward, whose activations
  are partly freed by then. defer() takes them as read. They hold what their files hold, so
  the steps in engine.step() keep them; anything that reads or writes the masters' files
  otherwise (what settles, below) and a skipped step (zero_grads) drop them first. The
  backward reaches their layers last: where a shard's file is its master's, its gathers
  take it from the master read (OptimizerSwap.mirror_shards), not from the file again.
  Measured on the 48M GPT, 2 ranks, 3 alternating pairs of runs: forward 0.06-0.07 s
  shorter, steps/s +4-6%, peak RSS the same within run-to-run noise (docs/benchmarks.md).
- A gather right after its sub-group stepped would wait for the write of the master's file
  when that file is also the shard's ([Note: one file for a shard and its master]): the new
  value is handed to the shard's ParamSwap, which gives it out from memory until the write
  is done (or, when a read-ahead counted on it, until that gather). The shard read-ahead
  stops at a parameter whose update is pending: its file holds the old value, and the new
  one comes from memory at its gather.
- An update runs wherever the read happens, also in an evaluation forward under
  torch.inference_mode(): it runs with inference mode off, so that the optimizer's state
  stays usable outside it.
- Whatever else reads the parameters, masters or optimizer state settles every pending
  update first (Stage3Strategy.settle): the next backward, the next engine.step(), checkpoint
  save and load, the 16-bit and fp32 state dicts, offload_states, and engine.destroy().
- Persistent parameters (kept gathered, never read from their shards) step in engine.step().
- sub_group_size left unset gives sub-groups of an eighth of the rank's deferred masters
  (early_sub_group_numel in nvme.py, shared with step_in_backward); with the key unset it is
  only an upper bound, and a model with nothing to defer steps in engine.step().
- A sub-group is read into the arena of one written before it ([Note: sub-group arenas]).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from .nvme import OptimizerSwap

EARLY_SUBS = 3  # sub-groups read during the backward: three in memory, as in the forward
EARLY_AFTER = 0.2  # of the deferred masters' gradients final: their reads then start


class ForwardSteps:
    def __init__(self, swap: OptimizerSwap) -> None:
        self.swap = swap
        self._subs: list[list[int]] = []  # this step's sub-groups, by position
        self._left: list[int] = []  # positions not stepped yet, in order
        self._pos: dict[int, int] = {}  # master index -> position of its pending sub-group
        self._grads: dict[int, torch.Tensor] = {}
        self._hyper: list[dict[str, Any]] = []
        self._reading: list[int] = []  # positions being read ahead (background lane)
        self._early: list[list[int]] = []  # sub-groups read during the backward
        self._writing: list[int] = []
        self.after_settle: Callable[[], None] | None = None  # once nothing is pending
        # sub-groups stepped when a shard was read, and by settle() (nothing read them first)
        swap.stats.setdefault("stepped_in_forward", 0)
        swap.stats.setdefault("stepped_at_settle", 0)
        swap.stats.setdefault("read_in_backward", 0)  # sub-groups

    @property
    def pending(self) -> bool:
        return bool(self._left) or bool(self._writing) or self.after_settle is not None

    def defer(self, grad_of: Callable[[int], torch.Tensor], skip: frozenset[int]) -> None:
        """engine.step(): every master not in `skip` (which the caller steps now) steps later,
        with grad_of(i) and the optimizer's hyperparameters as they are now."""
        self.settle()
        opt = self.swap.optimizer
        # copies of tensor values: torch's LR schedulers update a tensor lr in place
        self._hyper = [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
            for g in opt.param_groups
        ]
        self._subs = list(self.swap._sub_groups(skip))
        if self._early != self._subs[: len(self._early)]:  # other sub-groups (skip changed)
            self.drop_early()
        self._reading, self._early = list(range(len(self._early))), []
        self._left = list(range(len(self._subs)))
        for pos, sub in enumerate(self._subs):
            for i in sub:
                self._pos[i] = pos
                self._grads[i] = grad_of(i)
                self.swap.params[i].ds_step_pending = self.before_read
        self._read_ahead(-1)

    @torch.inference_mode(False)
    def before_read(self, p: Any) -> None:
        """p's shard is about to be read: its sub-group steps first."""
        pos = self._pos.get(self.swap.index[id(p)])
        if pos is not None:
            self._run(pos)
            self.swap.stats["stepped_in_forward"] += 1

    @torch.inference_mode(False)
    def settle(self) -> None:
        """Every pending update done and written; then after_settle (the deferred zeroing
        of gradient partitions a resident reducer reuses)."""
        if not self.pending:
            return
        while self._left:
            self._run(self._left[0])
            self.swap.stats["stepped_at_settle"] += 1
        self._forget(self._writing)
        self.swap.end_writes(self._writing)
        self._writing = []
        if self.after_settle is not None:
            done, self.after_settle = self.after_settle, None
            done()

    def read_early(self, skip: frozenset[int]) -> None:
        """A boundary backward is part way: the first sub-groups that the next defer(skip)
        will make start reading (background lane), unless some already are."""
        if self._early or self.pending:
            return
        for sub in itertools.islice(self.swap._sub_groups(skip), EARLY_SUBS):
            self.swap.read_group(sub, background=True)
            self._early.append(sub)  # only once submitted, as in _read_ahead
            self.swap.mirror_shards(sub)  # the backward still gathers these layers
            self.swap.stats["read_in_backward"] += 1

    @torch.inference_mode(False)
    def drop_early(self) -> None:
        """The sub-groups read during the backward leave memory unchanged (their files hold
        the same), their reads done."""
        if not self._early:
            return
        while self._early:
            sub = self._early[0]
            self.swap.wait_group(sub)  # an error leaves the rest for the next call
            self._early.pop(0)
            self.swap.drop_group(sub)
        self.swap.arenas.release_spare()

    def _hand_over(self, sub: list[int]) -> None:
        """A shard whose file is its master's (being written) is gathered from the master in
        memory: the gather right after this step does not wait for the write."""
        for i in sub:
            swap = self.swap.shared_swap(i)
            if swap is not None:
                swap.hand_over(self.swap.params[i], self.swap.masters[i].data)

    def _forget(self, sub: list[int]) -> None:
        for i in sub:
            p = self.swap.params[i]
            if p.ds_swap is not None:
                p.ds_swap.forget(p)

    def _read_ahead(self, after: int) -> None:
        """Unless one is being read, starts reading the next pending sub-group in order
        after position `after` (the forward's order), else the first. Reading two ahead
        measured no faster: the forward is then disk-bound (docs/benchmarks.md). Sub-groups
        read during the backward count as being read ahead.
        """
        if self._reading or not self._left:
            return
        later = [q for q in self._left if q > after]
        nxt = later[0] if later else self._left[0]
        self.swap.read_group(self._subs[nxt], background=True)
        self._reading.append(nxt)  # only once submitted: a failed submit leaves it unread

    def _run(self, pos: int) -> None:
        sub = self._subs[pos]
        if pos in self._reading:
            self._reading.remove(pos)
        else:  # gathered out of the expected order: read now, the read-aheads stay in flight
            self.swap.read_group(sub)
        self.swap.wait_group(sub)
        # From here the update must not run twice: its sub-group leaves the pending set
        # before the step (whose shard writes must not call back here) and stays out if
        # the step raises, the error reaching the caller.
        for i in sub:
            self.swap.params[i].ds_step_pending = None
            del self._pos[i]
        self._left.remove(pos)
        grads = self._grads.__getitem__
        self._forget(self._writing)  # step_and_write completes their writes
        try:
            self._writing = self.swap.step_and_write(sub, self._writing, grads, self._hyper)
            self._hand_over(sub)
        finally:
            for i in sub:
                del self._grads[i]
        self._read_ahead(pos)
        if not self._left:  # the last: only its own arena stays, until settle() ends its write
            self.swap.arenas.release_spare()
