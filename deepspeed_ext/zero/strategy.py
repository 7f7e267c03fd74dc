"""ZeRO stages 1 and 2 behind the gradient-strategy protocol ([Note: gradient strategy]):
partitions over the data-parallel group; the optimizer sees one flat fp32 master partition
per param group.

[Note: ZeRO with spread experts]
The params of MoE experts spread over ranks ([Note: expert groups]) differ from rank to rank
of the data-parallel group: each group of them is partitioned over its expert-data-parallel
group instead, as a ShardedGroup (and optimizer param group) of its own. Its buckets are
reduce-scattered over that group and scaled as the dense ones (by the data-parallel size:
each copy's gradient already holds every token of its expert-parallel group), its updated
chunks gathered over it. Every element of every param is then held by exactly one rank of
the data-parallel group, so the norm is one sum over that group. Checkpoints keep the
experts' state in their own files ([Note: expert checkpoint files]); the rank files hold
the dense groups only.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.comm import all_gather_bucket, collective_device, sum_tensor_over
from deepspeed_ext.comm.expert_groups import ExpertGroups, by_expert_groups, expert_groups_of
from deepspeed_ext.utils.logging import logger

from . import checkpoint
from .client_groups import source_groups
from .comm_options import reduce_options
from .fragments import Fragment, bind, state_owner
from .layout import GroupLayout, plan_group
from .module_state import load_module_state, module_state
from .named_state import NamedState, is_per_element, missing_names, own_copy
from .norms import sum_of_squares
from .protocol import RankFiles, StrategyContext, offloaded
from .reducer import ShardedReducer
from .reshard import chunks_for
from .sharded_group import ShardedGroup


class ZeroStrategy:
    partitioned_grads = True

    def __init__(self, ctx: StrategyContext, stage: int) -> None:
        self.stage = stage
        self.module = ctx.module
        self.dp = ctx.data
        self.world = ctx.data.size
        self.rank = ctx.data.rank
        bucket_numel = ctx.bucket_numel
        optimizer_device = ctx.optimizer_device
        names = {id(p): n for n, p in ctx.module.named_parameters()}
        self.groups: list[ShardedGroup] = []
        self.group_options: list[dict[str, Any]] = []
        # the dense groups first, then the spread experts' ([Note: ZeRO with spread experts]):
        # a rank whose experts are frozen has none of the latter, and the dense groups keep
        # their places in the optimizer (and the rank files) on every rank
        parts: list[tuple[ExpertGroups | None, list[tuple[str, Any]], dict[str, Any]]] = []
        experts: list[tuple[ExpertGroups | None, list[tuple[str, Any]], dict[str, Any]]] = []
        for g in ctx.model_groups:
            options = {k: v for k, v in g.items() if k != "params"}
            trainable = [p for p in g["params"] if p.requires_grad]
            named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(trainable)]
            spread = [(expert_groups_of(p), (n, p)) for n, p in named]
            parts.append((None, [x for e, x in spread if e is None], options))
            experts += [(e, part, options) for e, part in by_expert_groups(spread)]
        for expert, part, options in parts + experts:
            if not part:
                continue
            axis = ctx.data if expert is None else expert.expert_data
            layout = plan_group(
                [(n, tuple(p.shape), p.numel()) for n, p in part], axis.size, bucket_numel
            )
            self.groups.append(ShardedGroup(part, layout, axis, optimizer_device, expert))
            self.group_options.append(options)
        # where each of self.groups' masters sit in the optimizer: (param group, offset in
        # its params); a client optimizer's groups can hold several (repoint)
        self.opt_place: list[tuple[int, int]] = [(g, 0) for g in range(len(self.groups))]
        reduce_opts = reduce_options(ctx.zero, ctx.hierarchy)
        self.reducer = ShardedReducer(
            self.groups,
            ctx.accum_dtype,
            stage >= 2,
            ctx.data,
            lambda: ctx.is_boundary() and self.sync_enabled,
            averaging=ctx.averaging,
            host_grads=offloaded(ctx),
            exchange=ctx.grad_exchange,
            overlap=reduce_opts.overlap,
            scatter=reduce_opts.scatter,
            comm_dtype=ctx.comm_dtype,
            flat_scatter=reduce_opts.flat,
        )
        # [Note: ZeRO communication keys]: elements per all-gather, over all ranks
        self.allgather_numel = max(1, int(ctx.zero.allgather_bucket_size))
        self.exchange = ctx.grad_exchange  # its error buffers go to this rank's file
        self.sync_enabled = True
        # Our CPU optimizers take 16-bit grads for fp32 masters as they are; others get fp32.
        self.mixed_grads_ok = False

    # -- optimizer wiring --
    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        """Built from the groups given at construction: one fp32 master per bucket chunk."""
        return [
            {**opts, "params": list(grp.masters)}
            for grp, opts in zip(self.groups, self.group_options)
        ]

    def repoint(self, optimizer: torch.optim.Optimizer) -> None:
        """A client optimizer built on the model params: each of its groups holds the
        masters of the strategy groups made from it instead (a group of frozen params
        only, as a frozen pipeline stage's, left empty). Its groups stay as they are, in
        number and order, so a scheduler built on it before initialize still fits; a group
        split in two (weights tied across pipeline stages get a ZeRO group of their own)
        holds both groups' masters."""
        sources = source_groups(optimizer, [grp.params for grp in self.groups])
        self.opt_place = []
        for grp, i in zip(self.groups, sources):
            params = optimizer.param_groups[i]["params"]
            self.opt_place.append((i, len(params)))
            params.extend(grp.masters)

    # -- backward --
    def begin_backward(self, boundary: bool) -> None:
        if not self.sync_enabled and self.stage >= 2:
            raise RuntimeError(
                "no_sync() cannot be used with ZeRO stage 2: gradients are reduce-scattered "
                "every micro-step so that no rank keeps a full copy; use stage 0 or 1"
            )
        self.reducer.begin(boundary and self.sync_enabled)

    def end_backward(self) -> None:
        self.reducer.finish()

    # -- the step --
    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares over the whole replica's gradients (every partition)."""
        grads = [g for grp in self.groups for g in grp.grads]
        return sum_tensor_over(sum_of_squares(grads, collective_device(self.dp)), self.dp)

    def scale_grads_(self, factor: float) -> None:
        if factor != 1.0:
            for grp in self.groups:
                for g in grp.grads:
                    g.mul_(factor)

    def attach_optimizer(self, optimizer: Any) -> None:
        """Nothing to move (stage 3 sends NVMe-offloaded optimizer state to its files)."""
        self.optimizer = optimizer
        bind(list(self.module.parameters()), self)

    def state_roots(self, kind: str) -> list[torch.Tensor]:
        """Tensors whose storages hold one kind of state ([Note: offloading states]): the
        params live in each group's flat buffer; fp32 masters on the model's device are
        views of it (lp_params)."""
        params: list[torch.Tensor] = list(self.module.parameters())
        masters: list[torch.Tensor] = [
            m for grp in self.groups if not grp.masters_are_views for m in grp.masters
        ]
        if kind == "lp_params":
            return [grp.flat for grp in self.groups] + params
        if kind == "hp_params":
            return masters
        if kind == "lp_grads":
            held = [g for grp in self.groups for g in grp.grads]
            return held + [t.grad for t in params + masters if t.grad is not None]
        if kind == "contiguous_grad_buffer":
            return list(self.reducer.buffers.values())
        return []

    # -- [Note: param fragments]: a param's part of its bucket's chunk on each rank --
    def fragment_owner(self, p: Any, which: str) -> tuple[Fragment, torch.Tensor] | None:
        for grp in self.groups:
            slot = grp.slot_of.get(id(p))
            if slot is None:
                continue
            b = slot.bucket
            chunk = grp.layout.buckets[b].chunk(grp.world)
            frag = Fragment(chunk, slot.offset, slot.numel, p.shape, grp.rank, grp.axis)
            grad = grp.grads[b] if grp.grads else None
            owner = state_owner(self.optimizer, grp.masters[b], which, grad)
            return (frag, owner) if owner is not None else None
        return None

    @torch.no_grad()
    def write_model_param(self, p: Any, value: torch.Tensor) -> None:
        p.data.copy_(value.reshape(p.shape))  # a view into the flat buffer every rank holds

    def optimizer_step(self, optimizer: Any) -> None:
        optimizer.step()

    def before_step(self) -> None:
        for grp in self.groups:
            for m, g in zip(grp.masters, grp.grads):
                m.grad = g if g.dtype == m.dtype or self.mixed_grads_ok else g.float()

    @torch.no_grad()
    def after_step(self) -> None:
        """Each rank's updated chunks into the model's flat buffer, then every chunk to all."""
        works: list[Any] = []
        for grp in self.groups:
            piece = max(1, self.allgather_numel // grp.world)  # elements per rank per gather
            for b, m in enumerate(grp.masters):
                m.grad = None
                own = m.detach().to(grp.flat.device, dtype=grp.flat.dtype, non_blocking=True)
                if own.numel() > piece:
                    self._gather_in_pieces(grp, grp.bucket_view(b), own, piece)
                    continue
                works.append(all_gather_bucket(grp.bucket_view(b), own, group=grp.axis))
                if len(works) > 2:  # bound the backend's transient gather buffers
                    works.pop(0).wait()
        for w in works:
            w.wait()

    @staticmethod
    def _gather_in_pieces(
        grp: ShardedGroup, bucket: torch.Tensor, own: torch.Tensor, piece: int
    ) -> None:
        """allgather_bucket_size below a bucket: its chunks gathered piece by piece, each
        rank's slice of a piece landing in that rank's chunk of the bucket."""
        c = own.numel()
        for lo in range(0, c, piece):
            hi = min(c, lo + piece)
            outs = [bucket[r * c + lo : r * c + hi] for r in range(grp.world)]
            comm.all_gather(outs, own[lo:hi], group=grp.axis)

    def zero_grads(self) -> None:
        self.reducer.zero()

    def unused_params(self) -> list[str]:
        """Trainable params that got no gradient since the last step
        (zero_optimization.ignore_unused_parameters false refuses to step then)."""
        seen = self.reducer.seen
        return [
            grp.slot_of[id(p)].name for grp in self.groups for p in grp.params if id(p) not in seen
        ]

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()

    def grads_of(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        want = [id(p) for p in params]
        for grp in self.groups:
            if [id(p) for p in grp.params] == want:
                return list(grp.grads)
        raise ValueError(
            "grads_of: these params are not exactly one ZeRO param group (the pipeline engine "
            "puts each tied weight group in its own)"
        )

    # -- checkpoints: the module whole in the model states, partitions per rank --
    def model_state(self, optimizer: Any, exclude_frozen: bool) -> dict[str, Any]:
        return {"module": module_state(self.module, exclude_frozen), "zero_layouts": self.layouts()}

    def rank_state(self, optimizer: Any) -> dict[str, Any] | None:
        return checkpoint.rank_state(self, optimizer)

    def load_model_state(self, state: dict[str, Any], strict: bool, files: RankFiles) -> None:
        load_module_state(self.module, state, strict, files.where, self.stage)
        self.sync_masters_from_model()

    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any], files: RankFiles) -> None:
        checkpoint.load_partitions(self, optimizer, state, files)

    # -- checkpoint pieces: the rank files' groups, the dense ones ([Note: ZeRO with spread
    # experts]: the experts' state goes to their own files)
    def saved_groups(self) -> list[int]:
        return [g for g, grp in enumerate(self.groups) if grp.expert is None]

    def layouts(self) -> list[dict[str, Any]]:
        return [self.groups[g].layout.to_dict() for g in self.saved_groups()]

    def master_partitions(self) -> list[torch.Tensor]:
        return [self.groups[g].master_partition() for g in self.saved_groups()]

    @torch.no_grad()
    def load_master_partitions(self, saved: list[torch.Tensor]) -> None:
        """Every group's partition, in group order (a rank file's: the dense groups')."""
        for grp, t in zip(self.groups, saved, strict=True):
            grp.load_master_partition(t)
        self.after_step()  # the model's weights follow the masters

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        for grp in self.groups:
            if grp.masters_are_views:  # the model's own chunks are the masters
                continue
            for b, m in enumerate(grp.masters):
                m.copy_(grp.own_chunk(b))

    @torch.no_grad()
    def load_named_state(self, optimizer: Any, named: NamedState, where: Any) -> None:
        """[Note: named optimizer state]: cut into this rank's chunks of this layout."""
        if not self.groups:  # nothing trains here (a frozen pipeline stage)
            return
        current = optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        groups, masters = list(current["param_groups"]), []  # the groups of nothing stay
        placed: dict[int, int] = {}  # optimizer group -> the strategy group that set it
        for g, grp in enumerate(self.groups):
            lay = grp.layout
            names = [s.name for s in lay.slots]
            missing_names(named, names, where)
            own = chunks_for(lay, grp.rank, {n: named.masters[n] for n in names})
            masters.append(torch.cat(own))
            i, at = self.opt_place[g]
            ids = current["param_groups"][i]["params"][at : at + len(grp.masters)]
            numel = named.masters[names[0]].numel()
            for key, value in named.state[names[0]].items():
                if is_per_element(key, value, numel):
                    cut = chunks_for(lay, grp.rank, {n: named.state[n][key] for n in names})
                    for pid, c in zip(ids, cut):
                        state.setdefault(pid, {})[key] = c
                else:  # each its own (torch's Adam adds to `step` in place, per param)
                    for pid in ids:
                        state.setdefault(pid, {})[key] = own_copy(value)
            # the first strategy group placed in optimizer group i sets its options: a dense
            # one where it holds any (the same on every rank), not an expert part after it
            if i not in placed:
                placed[i] = g
                params = current["param_groups"][i]["params"]
                groups[i] = {**named.options[names[0]], "params": params}
            elif _options(named.options[names[0]]) != _options(groups[i]):
                logger.warning(
                    f"{where}: the params now in optimizer param group {i} were saved with "
                    "other group options (the grouping changed); the group keeps those of "
                    f"its first part ({self.groups[placed[i]].layout.slots[0].name})"
                )
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.load_master_partitions(masters)

    def group_layouts(self) -> list[GroupLayout]:
        return [grp.layout for grp in self.groups]

    def check_names(self, saved: list[GroupLayout]) -> None:
        now = [
            [(s.name, s.shape) for s in self.groups[g].layout.slots] for g in self.saved_groups()
        ]
        then = [[(s.name, s.shape) for s in g.slots] for g in saved]
        if sorted(map(sorted, now)) != sorted(map(sorted, then)):
            raise ValueError("the checkpoint's parameters do not match this model's (names/shapes)")

    def check_layouts(self, saved: list[dict[str, Any]]) -> None:
        now = [GroupLayout.from_dict(d) for d in self.layouts()]
        then = [GroupLayout.from_dict(d) for d in saved]
        if [d.slots for d in now] != [d.slots for d in then]:
            raise ValueError("the checkpoint's parameters do not match this model's (names/shapes)")


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
