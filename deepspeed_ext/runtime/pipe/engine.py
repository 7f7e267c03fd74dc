"""PipelineEngine: deepspeed.initialize's engine for a PipelineModule (upstream's API).

One call of train_batch() runs a whole batch: gradient_accumulation_steps micro-batches
through the stages on the 1F1B schedule (schedule.py; interleaved or ZB-H1 by config), then
the optimizer step shared with the data-parallel engine ([Note: optimizer step]). The
gradient strategy (stage 0, ZeRO 1 or 2) works per stage over the data-parallel group
exactly as without a pipeline: the pass that produces the batch's last micro-batch's weight
gradients (its backward, or its W under ZB-H1) runs with boundary=True.
First and last stages read the batch: (inputs, labels) per micro-batch; the returned loss is
the data-parallel mean of the batch's mean micro-batch loss, the same on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.comm.p2p import PipeAborted, PipeChannel, check_stage_output
from deepspeed_ext.monitor.writers import monitors_enabled
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.norms import sum_of_squares

from ..dataloader import DeepSpeedDataLoader, RepeatingLoader
from ..engine import DeepSpeedEngine
from ..precision import cast_half
from . import batch_start
from . import checkpoint as pipe_ckpt
from . import schedule as sch
from .additional_losses import AdditionalLosses, Meta, meta_key
from .batch_feed import Agreement, BatchFeed
from .checks import check_pipeline_config, schedule_for
from .errors import PipelineError
from .instruction_map import InstructionMap
from .module import PipelineModule
from .recv_slots import plan_recv_slots
from .split_backward import SplitPlan, plan_split
from .upstream_helpers import PipeUpstreamHelpers

# wall_clock_breakdown's pipeline timings, by upstream's names: on the metrics line and the
# monitors as <name>_ms, summed over the window. train_batch runs from train_batch()'s start
# to its optimizer step; the rest time the instructions that load a micro-batch and move
# activations and gradients between stages (a receive includes the wait for the sender).
TRAIN_BATCH_TIMER = "train_batch"
BATCH_INPUT_TIMER = "batch_input"
PIPE_SEND_OUTPUT_TIMER = "pipe_send_output"
PIPE_SEND_GRAD_TIMER = "pipe_send_grad"
PIPE_RECV_INPUT_TIMER = "pipe_recv_input"
PIPE_RECV_GRAD_TIMER = "pipe_recv_grad"
_TIMED: dict[type[sch.PipeInstruction], str] = {
    sch.LoadMicroBatch: BATCH_INPUT_TIMER,
    sch.SendActivation: PIPE_SEND_OUTPUT_TIMER,
    sch.SendGrad: PIPE_SEND_GRAD_TIMER,
    sch.RecvActivation: PIPE_RECV_INPUT_TIMER,
    sch.RecvGrad: PIPE_RECV_GRAD_TIMER,
}


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return tuple(_to_device(t, device) for t in x)
    return x


def _unaliased(out: Any, received: Any) -> Any:
    """`out`, with any tensor in it (nested in tuples, lists, dicts) that is a view of the
    received input (a stage that passes its input through) copied: the input's receive
    buffer is reused (plan_recv_slots)."""
    if received is None:
        return out
    ptrs = {t.untyped_storage().data_ptr() for t in _as_tuple(received)}

    def own(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.clone() if x.untyped_storage().data_ptr() in ptrs else x
        if isinstance(x, (tuple, list)):
            return type(x)(own(v) for v in x)
        if isinstance(x, dict):
            return {k: own(v) for k, v in x.items()}
        return x

    return own(out)


# what a batch runs before its data agreement is waited for (_run)
_BEFORE_AGREED = (sch.LoadMicroBatch, sch.ForwardPass)


class _NotAgreed(Exception):
    """Some stage's data failed: raised past _run's abort handling (nothing was sent)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class PipelineEngine(DeepSpeedEngine, PipeUpstreamHelpers):
    _engines = 0  # engines built in this process: tags their p2p messages
    # upstream's name for what runs each instruction (read-only: instruction_map.py)
    _INSTRUCTION_MAP = InstructionMap(
        {
            sch.LoadMicroBatch: "_exec_load_micro_batch",
            sch.RecvActivation: "_exec_recv_activations",
            sch.ForwardPass: "_exec_forward_pass",
            sch.SendActivation: "_exec_send_activations",
            sch.RecvGrad: "_exec_recv_grads",
            sch.BackwardPass: "_exec_backward_pass",
            sch.BackwardInputPass: "_exec_backward_input_pass",
            sch.BackwardWeightPass: "_exec_backward_weight_pass",
            sch.SendGrad: "_exec_send_grads",
            sch.ReduceTiedGrads: "_exec_reduce_tied_grads",
            sch.ReduceGrads: "_exec_reduce_grads",
            sch.OptimizerStep: "_exec_optimizer_step",
            sch.CommitP2P: "_exec_commit_p2p",
        }
    )
    pipeline_parallelism = True
    layouts = ("interleaved",)  # the module layouts (pipe_layout) its schedules run

    def __init__(self, model: PipelineModule, config: Any, mpu: Any = None, **kwargs: Any) -> None:
        if getattr(model, "pipe_layout", "interleaved") not in self.layouts:
            raise TypeError(
                f"{type(self).__name__} cannot run a {type(model).__name__} (its stages sit "
                f"as a {model.pipe_layout!r}): build the engine with deepspeed.initialize, "
                "which picks DualPipeVEngine for a DualPipeVModule"
            )
        check_pipeline_config(config, model, mpu)
        self._at_boundary = False  # is_gradient_accumulation_boundary(), as upstream's
        self._tied = model.tied  # read by _model_param_groups during construction
        self._tied.check_frozen_alike()
        self._loss_stage = model.loss_stage_id  # is_last_stage() is asked during construction
        self._chunk_stage, self._stage_chunk = model.chunk_stage, model.stage_chunk  # the layout
        self._chunk_trains = model.chunk_trains
        super().__init__(model, config, mpu=model.mpu(), **kwargs)
        self.grid = model.mpu()
        model.checkpoint_parallel_write_pipeline = bool(
            self.config.checkpoint.parallel_write.pipeline_stage
        )
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self.micro_batches = self.gradient_accumulation_steps()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.dp_world_size > 1
        # upstream's attributes, read by Megatron-DeepSpeed / GPT-NeoX style code
        self.is_model_parallel = self.layout.tensor.size > 1
        self.is_pipe_partitioned = self.is_model_parallel and self.config.pipeline.pipe_partitioned
        self.is_grad_partitioned = self.is_model_parallel and self.config.pipeline.grad_partitioned
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self._feed = BatchFeed(self.stage_id, self.rank, self._needs_data())
        self.chunks = model.virtual_stages
        self.schedule_name = schedule_for(config, model)
        if self.schedule_name == "interleaved":  # a batch size it cannot run: said now, not
            self._train_schedule()  # at the first train_batch
        PipelineEngine._engines += 1  # every rank builds its engines in the same order
        self._make_channels(model.dynamic_shape, PipelineEngine._engines * 4096)
        if self.training_dataloader is not None and self._needs_data():
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        # upstream's loss attributes: the batch loss averaged over the data-parallel ranks
        # (train_batch returns it), this replica's own, both on every stage; and the last
        # stage's sum of its micro-batch losses (None on the other stages)
        self.agg_train_loss: torch.Tensor | None = None
        self.dp_group_loss: torch.Tensor | None = None
        self.total_loss: torch.Tensor | None = None
        self._extras = AdditionalLosses(self.metrics)  # [Note: additional losses]
        self._compute_loss = True
        self.eval_return_logits = False  # upstream's names: eval_batch(return_logits=True)
        self.outputs: Any = None  # ... keeps the last stage's outputs here
        self.dynamic_shape = model.dynamic_shape  # upstream's: shapes renegotiated per message
        self._norm_layers: list[Any] | None = None  # batch_start's, found once
        self._ckpt_same_layout = True  # set by each load_checkpoint
        self._ckpt_upstream = False  # ... and whether upstream's engine wrote it
        self.unsplit_backwards = 0  # zb-h1 backwards that ran whole ([Note: split backward])
        self._batch_t0 = 0.0  # when the running train_batch() started (TRAIN_BATCH_TIMER)
        # upstream's flag (set_has_attention_mask), on by itself for Megatron's GPT2 pipe
        self.has_attention_mask = type(model).__name__ == "GPT2ModelPipe"
        self._failed: str | None = None  # a batch that failed mid-schedule ([Note: pipeline p2p])
        self._reset_buffers()

    def _make_channels(self, dyn: bool, base: int) -> None:
        """Per model chunk c (virtual stage V, placed by the module's chunk_stage):
        activations come from the rank holding V-1 and go to the one holding V+1; gradients
        the other way. An edge's tag is the lower virtual stage's, so both ends agree on it.
        A neighbour on this rank (DualPipeV's turn) gets no channel: _hand_on maps the chunk
        before the turn to the one after, which gets its inputs in-process."""
        r, last = self.stage_id, self.num_stages * self.chunks - 1
        # under tensor slicing each tensor rank sends 1/n ([Note: partitioned p2p])
        pipe_cfg = self.config.pipeline
        acts = self.layout.tensor if pipe_cfg.pipe_partitioned else None
        grads = self.layout.tensor if pipe_cfg.grad_partitioned else None
        self._act_in: dict[int, PipeChannel] = {}
        self._act_out: dict[int, PipeChannel] = {}
        self._grad_in: dict[int, PipeChannel] = {}
        self._grad_out: dict[int, PipeChannel] = {}
        self._hand_on: dict[int, int] = {}
        groups = self._edge_groups()
        for c in range(self.chunks):
            v = self._chunk_stage(c)
            if v > 0:
                stage, _ = self._stage_chunk(v - 1)
                peer = self.grid.stage_to_global(stage)
                if stage != r:
                    g = groups.get(v - 1)
                    what = f"activations into virtual stage {v}"
                    self._act_in[c] = PipeChannel(
                        peer, what, dyn, base + v - 1, split=acts, group=g
                    )
                    what = f"input gradients of virtual stage {v}"
                    self._grad_out[c] = PipeChannel(
                        peer, what, dyn, base + v - 1, split=grads, group=g
                    )
            if v < last:
                stage, nxt = self._stage_chunk(v + 1)
                peer = self.grid.stage_to_global(stage)
                if stage == r:
                    self._hand_on[c] = nxt
                    continue
                g = groups.get(v)
                what = f"output of virtual stage {v}"
                self._act_out[c] = PipeChannel(peer, what, dyn, base + v, split=acts, group=g)
                what = f"gradients into virtual stage {v}"
                self._grad_in[c] = PipeChannel(peer, what, dyn, base + v, split=grads, group=g)

    def _edge_groups(self) -> dict[int, Any]:
        """With model chunks, a process group per edge between virtual stages v and v+1 of
        each pipeline (made on every rank, in one order), keyed by v for this rank's edges:
        two ranks then exchange several channels' messages one way (DualPipeV: chunk 0's
        activations and chunk 1's gradients), which tags keep apart on gloo but NCCL, which
        ignores tags, would match in posting order. One chunk: the world's group."""
        if self.chunks == 1:
            return {}
        topo = self.grid.topology()
        axes = [a for a in topo.get_axis_names() if a != "pipe"]
        columns = sorted(
            {tuple(getattr(topo.get_coord(x), a) for a in axes) for x in range(topo.world_size())}
        )
        me, last = comm.get_rank(), self.num_stages * self.chunks - 1
        mine: dict[int, Any] = {}
        for col in columns:
            fixed = dict(zip(axes, col))
            for v in range(last):
                a, b = self._stage_chunk(v)[0], self._stage_chunk(v + 1)[0]
                if a == b:  # the turn: no message
                    continue
                ranks = sorted((topo.get_rank(pipe=a, **fixed), topo.get_rank(pipe=b, **fixed)))
                group = comm.new_group(ranks)
                if me in ranks:
                    mine[v] = group
        return mine

    def _is_first(self, c: int) -> bool:
        return self._chunk_stage(c) == 0

    def _is_last(self, c: int) -> bool:
        return self._chunk_stage(c) == self.num_stages * self.chunks - 1

    # -- construction hooks --
    def _model_param_groups(self, client: Any, model_parameters: Any) -> list[dict[str, Any]]:
        """Each tied key's params in a group of their own, so that ZeRO lays their gradients
        out the same on every stage holding them ([Note: tied weights])."""
        groups = super()._model_param_groups(client, model_parameters)
        tied = self._tied.entries()
        if not tied or self.zero_optimization_stage() == 0:  # stage 0 reduces per param
            return groups
        key_of = {id(p): k for k, ps, _ in tied for p in ps}
        # a client optimizer object's group split in two holds both parts' masters
        # (ZeroStrategy.repoint); a key spread over several groups cannot be one
        for key, _, _ in tied:
            spread = [g for g in groups if any(key_of.get(id(p)) == key for p in g["params"])]
            if len(spread) > 1:
                raise ValueError(
                    f"the weights tied under TiedLayerSpec key {key!r} are in {len(spread)} "
                    "of the param groups (the optimizer's, or model_parameters'): ZeRO keeps "
                    "a tied key in one group of its own, with one group's options; put them "
                    "in one param group"
                )
        out: list[dict[str, Any]] = []
        extra: dict[str, dict[str, Any]] = {}
        for g in groups:
            out.append(dict(g, params=[p for p in g["params"] if id(p) not in key_of]))
            for p in g["params"]:
                if id(p) in key_of and key_of[id(p)] not in extra:
                    extra[key_of[id(p)]] = dict(g, params=[])
        for k, ps, _ in tied:
            if k in extra:
                extra[k]["params"] = list(ps)  # the key's attribute order, on every stage
        return [g for g in out if g["params"]] + [extra[k] for k in sorted(extra)]

    def _training_loader(self, dataset: Any, collate_fn: Any) -> Any:
        """As upstream's pipeline engine reads training_data: in order (no shuffle), a shard
        per data-parallel rank; the first and last stages read the same samples."""
        return DeepSpeedDataLoader(
            dataset,
            self.train_micro_batch_size_per_gpu(),
            collate_fn=collate_fn,
            data_parallel_world_size=self.dp_world_size,
            data_parallel_rank=self.dp_rank,
            dataloader_drop_last=bool(self.config.dataloader_drop_last),
            shuffle=False,
        )

    def _bucket_numel(self, params: list[torch.nn.Parameter], elem: int) -> int:
        """The same on every stage: tied groups then get the same ZeRO layout everywhere."""
        mine = torch.tensor(
            float(super()._bucket_numel(params, elem)),
            dtype=torch.float64,
            device=comm.collective_device(self.layout.pipe),
        )
        comm.all_reduce(mine, op=comm.ReduceOp.MAX, group=self.layout.pipe)
        return int(mine)

    # -- upstream's queries --
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this stage computes the loss: the last one, or under DualPipeV stage 0."""
        return self.stage_id == self._loss_stage

    def _needs_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        if self._needs_data():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        """One pass over `loader`, as upstream: train_batch raises StopIteration at its end
        (an epoch loop's signal); wrap it in deepspeed.utils.RepeatingLoader to go on."""
        if self._needs_data():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_has_attention_mask(self, value: bool) -> None:
        """Upstream's flag for a boolean attention mask passed between stages as the last
        tensor (upstream casts it for NCCL and sends no gradient for it). Here every tensor
        travels as bytes in its own dtype and a non-float one never gets a gradient, so a
        mask needs no flag; it is recorded (`has_attention_mask`) for upstream's callers."""
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask({value!r}): pass True or False")
        self.has_attention_mask = value

    def reset_activation_shape(self) -> None:
        """Upstream's call before a batch whose activation and gradient shapes differ from
        the last (curriculum learning's growing sequences): each of this rank's next sends
        may carry new shapes, negotiated again. Call it on every rank."""
        for ch in [*self._act_out.values(), *self._grad_out.values()]:
            ch.renegotiate()

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        self.batch_fn = fn

    @property
    def data_iterator(self) -> Iterator[Any] | None:
        """Upstream's attribute: where this stage's micro-batches come from."""
        return self._feed.iterator

    @data_iterator.setter
    def data_iterator(self, iterator: Iterator[Any] | None) -> None:
        self._feed.iterator = iterator

    @property
    def batch_fn(self) -> Callable[[Any], Any] | None:
        """Upstream's post-processing of each batch (set_batch_fn, or assigned)."""
        return self._feed.batch_fn

    @batch_fn.setter
    def batch_fn(self, fn: Callable[[Any], Any] | None) -> None:
        self._feed.batch_fn = fn

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    @property
    def total_additional_losses(self) -> Any:
        """Upstream's: the last stage's sums of this batch's additional losses, by name."""
        return self._extras.total

    @property
    def agg_additional_losses(self) -> Any:
        """Upstream's: this batch's additional losses averaged over its micro-batches and the
        data-parallel ranks, by name, on every stage ([Note: additional losses])."""
        return self._extras.agg

    @property
    def first_output_send(self) -> bool:
        """Upstream's flag: whether the next send negotiates shapes first. Setting it True
        (GPT-NeoX does before a generation of new shapes) is reset_activation_shape()."""
        return any(ch.sent_meta is None or ch.reshape_next for ch in self._act_out.values())

    @first_output_send.setter
    def first_output_send(self, value: bool) -> None:
        if value:
            self.reset_activation_shape()

    # -- checkpoints ([Note: pipeline checkpoint]) --
    def _write_module_files(self, tmp: Any, exclude_frozen: bool) -> None:
        pipe_ckpt.write_layers(self, tmp, exclude_frozen)

    def _checkpoint_extras(self, tmp: Any, exclude_frozen: bool) -> dict[str, Any]:
        return pipe_ckpt.extras(self)

    def _checkpoint_state(self, ckpt_dir: Any, path: Any, strict: bool) -> dict[str, Any]:
        return pipe_ckpt.state_for_load(self, ckpt_dir, path, strict)

    def _load_optimizer_state(self, state: dict[str, Any], files: Any) -> None:
        pipe_ckpt.load_optimizer(self, state, files)

    # -- the data-parallel engine's per-micro-batch API is not a pipeline's --
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            "a PipelineEngine runs whole batches: call engine.train_batch(data_iter) (or "
            "eval_batch), not engine(batch)/backward/step"
        )

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        self.forward()

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.forward()

    # -- batches --
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        self._check_not_failed()
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() needs gradients: call it outside torch.no_grad()")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self._feed.check(self.world_size, self._comm_device)
        self.module.train()
        self._compute_loss = True
        self._extras.total = None
        self._batch_t0 = self.timers.now()
        self.total_loss = self.agg_train_loss = None
        # the batch's micro-batches are read before any stage sends, as eval_batch's: data
        # running out (an epoch's end, set_dataloader's one pass) raises StopIteration on
        # every rank, stages between included, and the engine goes on with new data (upstream
        # raises on the data stages only, and the others wait for activations forever)
        try:
            agreed = self._feed.prefetch(self.micro_batches, self._comm_device, "train_batch")
            # waited for at once when this rank's data failed (it raises), and under tensor
            # slicing, whose first forward all-reduces with peers that may have to stop
            overlap = agreed.failed is None and self.layout.tensor.size == 1
            if not overlap:
                agreed.wait()
            self._run(self._train_schedule(), agreed if overlap else None)
        finally:
            self._feed.drop_prefetched()
        assert self.agg_train_loss is not None  # set by the schedule's OptimizerStep
        self.micro_steps += self.micro_batches
        self.global_samples += self.train_batch_size()
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        self._check_not_failed()
        if reduce_output not in (None, "avg"):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        if num_micro_batches is not None and (
            not isinstance(num_micro_batches, int) or num_micro_batches < 1
        ):
            raise ValueError(
                f"eval_batch(num_micro_batches={num_micro_batches!r}): give a positive count, "
                "or None for gradient_accumulation_steps"
            )
        saved = self.data_iterator
        if self._needs_data():  # not set_dataiterator: the training loader stays set
            self.data_iterator = data_iter
        self._feed.check(self.world_size, self._comm_device)
        self.module.eval()
        self._compute_loss = compute_loss
        self.eval_return_logits = return_logits
        m = num_micro_batches or self.micro_batches
        try:
            self._feed.prefetch(m, self._comm_device, "eval_batch").wait()
            with torch.no_grad():
                self._run(self._inference_schedule(m))
            out: Any = None
            self.total_loss = None
            if self.is_last_stage():
                outs = self._losses
                self.total_loss = self._loss_sum() if compute_loss else None
                out = outs if reduce_output is None else self._mean_over_data(outs, m)
            # the monitors (rank 0, the first stage) get it as upstream's eval_loss event
            monitored = monitors_enabled(self.config)
            if compute_loss and reduce_output is not None and (bcast_loss or monitored):
                out = self._from_last_stage(out)
                for w in self.metrics.writers:
                    w.write(self.global_steps, self.global_samples, {"eval_loss": float(out)})
        finally:
            self.data_iterator = saved
            self._feed.drop_prefetched()
            self.eval_return_logits = False
            self.module.train()
        if return_logits:
            logits, self.outputs = self.outputs, None
            return out, logits
        return out

    # -- the schedule --
    def _inference_schedule(self, micro_batches: int) -> sch.PipeSchedule:
        return sch.InferenceSchedule(micro_batches, self.num_stages, self.stage_id, self.chunks)

    def _train_schedule(self) -> sch.PipeSchedule:
        m, p, s = self.micro_batches, self.num_stages, self.stage_id
        if self.chunks > 1:
            return sch.InterleavedTrainSchedule(m, p, s, self.chunks)
        if self.schedule_name == "zb-h1":
            return sch.ZeroBubbleH1Schedule(m, p, s)
        return sch.TrainSchedule(m, p, s)

    def _reset_buffers(self) -> None:
        # keyed by (chunk, buffer id)
        self._inputs: dict[tuple[int, int], Any] = {}
        self._labels: dict[tuple[int, int], Any] = {}
        self._outputs: dict[tuple[int, int], Any] = {}
        self._input_grads: dict[tuple[int, int], Any] = {}
        self._weight_passes: dict[tuple[int, int], SplitPlan | None] = {}
        self._grads_in: dict[int, tuple[torch.Tensor, ...]] = {}
        self._batches: dict[int, Any] = {}  # micro-batch -> its batch, pulled once
        self._losses: list[torch.Tensor] = []
        self._backwards_left = 0

    def _run(self, sched: sch.PipeSchedule, agreed: Agreement | None = None) -> None:
        """Run a batch's instructions. With `agreed` (train_batch's data agreement), its
        first micro-batch loads and forwards meanwhile; before anything else (a message, a
        collective) the batch stops on every rank if some stage's data failed: nothing has
        been sent then, so the engine goes on as if the batch had not started (batch_start:
        the forward's counts, random draws and norm statistics are put back)."""
        self._reset_buffers()
        trains = (sch.TrainSchedule, sch.InterleavedTrainSchedule, sch.DualPipeVSchedule)
        if isinstance(sched, trains) and not getattr(sched, "forward_only", False):
            self._backwards_left = sched.micro_batches * self.chunks
        handlers: dict[type, Callable[[Any], None]] = {
            kind: getattr(self, name) for kind, name in self._INSTRUCTION_MAP.items()
        }
        boundary: tuple[type, ...] = (sch.ReduceTiedGrads, sch.OptimizerStep)
        for kind in boundary:
            handlers[kind] = self._at_the_boundary(handlers[kind])
        if self.timers.enabled:
            for kind, name in _TIMED.items():
                handlers[kind] = self._timed(handlers[kind], name)
        senders = [*self._act_out.values(), *self._grad_out.values()]
        plan = list(sched.steps())
        unknown = {type(cmd) for step in plan for cmd in step} - handlers.keys()
        if unknown:  # before anything runs (a schedule written for upstream's engine)
            names = sorted(k.__name__ for k in unknown)
            runs = sorted(k.__name__ for k in handlers)
            raise PipelineError(
                f"{type(self).__name__} does not run instruction(s) {names}: it runs {runs}"
            )
        self._recv_slot = plan_recv_slots(plan)  # keyed by id(): `plan` outlives its use
        if agreed is None:
            self._expect_receives(plan)
        start = None
        if agreed is not None:
            if self._norm_layers is None:
                self._norm_layers = batch_start.norm_layers(self.module)
            start = batch_start.mark(self.module, self.metrics, self._norm_layers)
        try:
            for step in plan:
                for cmd in step:
                    if agreed is not None and not isinstance(cmd, _BEFORE_AGREED):
                        try:
                            agreed.wait()
                        except BaseException as e:
                            raise _NotAgreed(e) from e
                        agreed = None
                        self._expect_receives(plan)
                    handlers[type(cmd)](cmd)
            for ch in senders:
                ch.wait_sends()
        except _NotAgreed as stop:
            assert start is not None
            batch_start.rewind(start, self.module, self.metrics)
            raise stop.error from None
        except BaseException as e:
            # tell the neighbours, so they raise instead of waiting ([Note: pipeline p2p]);
            # messages of this batch may stay in flight, so no later batch may run on them
            for ch in senders:
                ch.abort()
            self._failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            raise
        finally:  # free the activations; the losses stay for eval_batch to read
            losses = self._losses
            self._reset_buffers()
            self._losses = losses

    def _at_the_boundary(self, handler: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(cmd: Any) -> None:
            self._at_boundary = True
            try:
                handler(cmd)
            finally:
                self._at_boundary = False

        return run

    def is_gradient_accumulation_boundary(self) -> bool:
        """As upstream's pipeline engine: True only while the batch's gradients are reduced
        across tied stages and the optimizer steps; False in the micro-batches' passes
        (where the gradient strategy is told the boundary itself) and between batches."""
        return self._at_boundary

    def _expect_receives(self, plan: list[list[sch.PipeInstruction]]) -> None:
        """Tell each receiving channel how many messages this batch brings, so that it can
        post each next receive early ([Note: pipeline p2p])."""
        recvs = (sch.RecvActivation, sch.RecvGrad)
        cmds = [cmd for step in plan for cmd in step if isinstance(cmd, recvs)]
        counts = Counter((type(cmd), self._key(cmd)[0]) for cmd in cmds)
        for (kind, c), n in counts.items():
            (self._act_in if kind is sch.RecvActivation else self._grad_in)[c].expect(n)

    def _check_not_failed(self) -> None:
        if self._failed is not None:
            raise PipelineError(
                f"an earlier batch failed on stage {self.stage_id} ({self._failed}): messages "
                "of that batch between stages may still be in flight, so this engine cannot "
                "run another batch (it would read them as this one's). Build a new engine "
                "(deepspeed.initialize, then load_checkpoint to resume) or restart the job"
            )

    def _timed(self, handler: Callable[[Any], None], name: str) -> Callable[[Any], None]:
        def run(cmd: Any) -> None:
            with self.timers.span(name):
                handler(cmd)

        return run

    _key = staticmethod(sch.chunk_and_buffer)

    def _exec_load_micro_batch(self, cmd: sch.LoadMicroBatch) -> None:
        c, b = self._key(cmd)
        mb = cmd.kwargs.get("micro_batch", b)
        batch = self._batches.pop(mb, None)
        if batch is None:
            batch = self._feed.next()
            if self._is_first(c) and self.is_last_stage() and self.chunks > 1:
                self._batches[mb] = batch  # its last chunk reads the same micro-batch
        if self._is_first(c):
            self._inputs[(c, b)] = _to_device(batch[0], self.device)
            samples = batch[0][0] if isinstance(batch[0], (tuple, list)) else batch[0]
            n = int(samples.shape[0]) if isinstance(samples, torch.Tensor) and samples.dim() else 0
            self.metrics.add_micro_batch(n, None)
        if self._is_last(c):
            self._labels[(c, b)] = _to_device(batch[1], self.device)

    def _exec_recv_activations(self, cmd: sch.RecvActivation) -> None:
        c, b = self._key(cmd)
        ch = self._act_in[c]
        bufs = ch.recv(self._recv_slot[id(cmd)])
        assert ch.recv_meta is not None
        grad = torch.is_grad_enabled()
        ins = tuple(
            t.detach().requires_grad_(flag and grad and t.is_floating_point())
            for t, (_, flag, _) in zip(bufs, ch.recv_meta)
        )
        self._inputs[(c, b)] = ins[0] if len(ins) == 1 else ins

    def _exec_forward_pass(self, cmd: sch.ForwardPass) -> None:
        c, b = self._key(cmd)
        with self.timers.phase("forward"):
            inputs = self._inputs[(c, b)]
            if self._auto_cast:  # fp16.auto_cast, as the engine's forward
                inputs = cast_half(inputs)
            with self.autocast_forward():  # [Note: torch_autocast]
                out = self.module(inputs, chunk=c)
        if not self._is_last(c):
            self._outputs[(c, b)] = out
            if c in self._hand_on:
                self._turn(c, b, out)
            return
        received = self._inputs.get((c, b))
        if not torch.is_grad_enabled():  # eval keeps it past this slot's next receive
            out = _unaliased(out, received)
        loss_fn: Any = getattr(self.module, "loss_fn", None)
        if self._compute_loss and loss_fn is not None:
            loss = loss_fn(out, self._labels.pop((c, b)))
        else:
            loss = out
        if self._compute_loss and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"the last stage computed {shape}, not a scalar loss: give PipelineModule "
                "loss_fn=<callable(outputs, labels) -> scalar>, or make the last layer return "
                "the loss"
            )
        if self.eval_return_logits:
            self.outputs = out
        self._outputs[(c, b)] = loss
        kept = loss.detach() if isinstance(loss, torch.Tensor) else loss
        if torch.is_grad_enabled():  # (eval's `out` is a copy already, above)
            # read at the step, after this slot's next receive: a loss passed through is a view
            kept = _unaliased(kept, received)
        self._losses.append(kept)
        hook: Any = getattr(self.module, "get_additional_losses", None)
        if hook is not None and torch.is_grad_enabled():  # a training batch
            self._extras.add(hook())

    def _turn(self, c: int, b: int, out: Any) -> None:
        """DualPipeV's turn: chunk c's output is the next chunk's input on this rank, cut
        from c's graph as a received one would be; its gradient comes back in _backward_roots."""
        nxt = self._hand_on[c]
        check_stage_output(_as_tuple(out), f"output of virtual stage {self._chunk_stage(c)}")
        if not torch.is_grad_enabled():
            self._inputs[(nxt, b)] = out
            del self._outputs[(c, b)]
            self._inputs.pop((c, b), None)
            return
        ins = tuple(t.detach().requires_grad_(t.requires_grad) for t in _as_tuple(out))
        self._inputs[(nxt, b)] = ins[0] if len(ins) == 1 else ins

    def _exec_send_activations(self, cmd: sch.SendActivation) -> None:
        key = self._key(cmd)
        outs = _as_tuple(self._outputs[key])
        if torch.is_grad_enabled() and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in outs
        ):
            self._check_gradient_not_cut(*key)
        self._act_out[key[0]].send(outs)
        if not torch.is_grad_enabled():
            del self._outputs[key]
            self._inputs.pop(key, None)

    def _exec_recv_grads(self, cmd: sch.RecvGrad) -> None:
        c = self._key(cmd)[0]
        # a split backward's W reads these gradients later (its join nodes' seeds can be
        # them): the slot stays theirs until then (plan_recv_slots)
        self._grads_in[c] = self._grad_in[c].recv(self._recv_slot[id(cmd)])

    def _backward_roots(self, c: int, b: int) -> tuple[list[torch.Tensor], list[Any]]:
        """The tensors a micro-batch's backward starts from, and their gradients."""
        if self._is_last(c):
            scaled = self._outputs.pop((c, b)).float() / self.micro_batches
            if self.loss_scaler is not None:
                scaled = scaled * self.loss_scaler.loss_scale
            return [scaled], [None]
        outs = [o for o in _as_tuple(self._outputs.pop((c, b))) if o.requires_grad]
        if c in self._hand_on:  # the turn: the next chunk's input gradients, on this rank
            self._inputs.pop((self._hand_on[c], b), None)
            grads = list(self._input_grads.pop((self._hand_on[c], b), ()))
        else:
            grads = list(self._grads_in.pop(c))
        if len(outs) != len(grads):
            raise RuntimeError(
                f"stage {self.stage_id}: {len(outs)} outputs need gradients but the "
                f"next stage sent {len(grads)}"
            )
        return outs, grads

    def _grad_inputs(self, c: int, b: int) -> list[torch.Tensor]:
        if self._is_first(c):
            return []
        return [t for t in _as_tuple(self._inputs[(c, b)]) if t.requires_grad]

    def _backward_whole(self, c: int, b: int, boundary: bool, roots: Any = None) -> None:
        """Input and weight gradients in one autograd pass, the strategy around it."""
        outs, grads = roots or self._backward_roots(c, b)
        self.strategy.begin_backward(boundary)
        with self.timers.phase("backward"):
            torch.autograd.backward(outs, grad_tensors=grads)
            self.strategy.end_backward()
        ins = self._grad_inputs(c, b)
        self._keep_input_grads(c, b, ins, [t.grad for t in ins])

    def _keep_input_grads(self, c: int, b: int, ins: list[torch.Tensor], grads: Any) -> None:
        if ins:
            self._input_grads[(c, b)] = tuple(
                g if g is not None else torch.zeros_like(t) for g, t in zip(grads, ins)
            )

    def _exec_backward_pass(self, cmd: sch.BackwardPass) -> None:
        self._backwards_left -= 1
        self._backward_whole(*self._key(cmd), boundary=self._backwards_left == 0)

    def _exec_backward_input_pass(self, cmd: sch.BackwardInputPass) -> None:
        """B of a zero-bubble schedule; its W runs at BackwardWeightPass
        ([Note: split backward]). A graph that cannot be cut runs whole here."""
        c, b = self._key(cmd)
        ins = self._grad_inputs(c, b)
        outs, grads = self._backward_roots(c, b)
        params = [p for p in self.module.parameters() if p.requires_grad]
        plan = plan_split(outs, grads, ins, params)
        if isinstance(plan, str):
            self._weight_passes[(c, b)] = None
            self.unsplit_backwards += 1
            if self.unsplit_backwards == 1:
                logger.warning(
                    f"pipeline.schedule {self.schedule_name}: stage {self.stage_id}'s backward "
                    f"cannot be split into input- and weight-gradient passes: {plan}. It runs "
                    "whole, so this stage idles as without the split (engine.unsplit_backwards "
                    "counts them)"
                )
            self._backward_whole(c, b, boundary=False, roots=(outs, grads))
            return
        self._weight_passes[(c, b)] = plan
        with self.timers.phase("backward"):
            self._keep_input_grads(c, b, ins, plan.input_pass())

    def _exec_backward_weight_pass(self, cmd: sch.BackwardWeightPass) -> None:
        plan = self._weight_passes.pop(self._key(cmd))
        self._backwards_left -= 1
        boundary = self._backwards_left == 0
        if plan is None and not boundary:
            return  # B ran the whole backward
        self.strategy.begin_backward(boundary)
        with self.timers.phase("backward"):
            if plan is not None:
                plan.weight_pass()
            self.strategy.end_backward()

    def _exec_send_grads(self, cmd: sch.SendGrad) -> None:
        key = self._key(cmd)
        # none: the previous stage sent nothing that needs a gradient (it trains nothing, as
        # it checked before sending): an empty message completes its schedule's receive
        grads = self._input_grads.pop(key, ())
        self._grad_out[key[0]].send(grads)
        self._inputs.pop(key, None)

    def _check_gradient_not_cut(self, c: int, b: int) -> None:
        """A stage whose output needs no gradient must train nothing, and get no input that
        needs one: else what trains at or before it never gets a gradient (or trains on
        zeros) while the loss says nothing is wrong."""
        needed = bool(self._grad_inputs(c, b))
        trains = self._chunk_trains(c)
        if not (trains or needed):
            return  # frozen layers over data (fine-tuning the rest): rightly no gradient
        nxt = self._stage_chunk(self._chunk_stage(c) + 1)[0]
        why = (
            "it has parameters to train"
            if trains
            else "its input needs one (the stages before it train)"
        )
        raise PipelineError(
            f"stage {self.stage_id} sends stage {nxt} an output that needs no gradient, yet "
            f"{why}: the output does not depend on them, so they would never get a "
            "gradient. A layer detaches it (torch.no_grad, .detach()), or reentrant "
            "activation checkpointing does, over layers whose inputs need no gradient "
            "(token ids): use the default activation_checkpoint_func (use_reentrant=False), "
            "or checkpointable_layers to leave such layers out; or freeze what should not "
            "train (requires_grad=False)"
        )

    def _exec_reduce_grads(self, cmd: sch.ReduceGrads) -> None:
        """Nothing: the strategy reduced in the batch's last backward ([Note: gradient
        strategy])."""

    def _exec_commit_p2p(self, cmd: sch.CommitP2P) -> None:
        """Nothing: sends go out at once ([Note: pipeline p2p])."""

    def _exec_reduce_tied_grads(self, cmd: sch.ReduceTiedGrads) -> None:
        for params, group in self._tied.trained():
            for g in self.strategy.grads_of(params):
                comm.all_reduce(g, group=group)

    def _exec_optimizer_step(self, cmd: sch.OptimizerStep) -> None:
        replicated = [
            p
            for p in self._tied.params()
            if p.requires_grad and getattr(p, "ds_pipe_replicated", False)
        ]
        sq: torch.Tensor | float = 0.0
        if replicated:
            sq = sum_of_squares(self.strategy.grads_of(replicated), self._comm_device)
            if self.strategy.partitioned_grads:
                sq = comm.sum_tensor_over(sq, self.layout.data)
        # the batch loss rides on the norm's pipe-group sum: the last stage adds it, the
        # others 0, so every stage learns it without a broadcast of its own; so do the
        # additional losses' count and key ([Note: additional losses])
        ride = torch.zeros(5, dtype=torch.float64, device=self._comm_device)
        extra: torch.Tensor | None = None
        meta: Meta = ()
        # the sum runs over the tensor slices too: one of them counts the loss
        counts = self._norm_axis is self.layout.pipe or self.layout.tensor.rank == 0
        if self.is_last_stage():  # every rank joins the data-parallel all-reduces
            loss, mine, values, meta, agreed = self._extras.batch_means(
                self._losses, self.micro_batches, self.layout.data, self._comm_device
            )
            if counts:
                ride[0], extra = loss, values
                ride[1], ride[2] = values.numel(), meta_key(meta)
                ride[4] = mine
            ride[3] = 0.0 if agreed else 1.0
            self.total_loss = self._loss_sum()
        with self.timers.phase("step"):
            out = self._model_step({}, replicated_sq=sq, pipe_extra=ride)
        total, n, key, disagreed, own = out.pipe_sums
        # on the device, as upstream's (code may all-reduce it over NCCL)
        self.agg_train_loss = torch.tensor(total, dtype=torch.float32, device=self.device)
        self.dp_group_loss = torch.tensor(own, dtype=torch.float32, device=self.device)
        self.metrics.add_loss(self.agg_train_loss)
        self._extras.share(int(n), key, disagreed, extra, meta, self._norm_axis, self._comm_device)
        self.timers.since(TRAIN_BATCH_TIMER, self._batch_t0)  # before the window below closes
        if self.slow_nodes is not None:
            self.slow_nodes.on_step(self.global_steps)
        self.metrics.on_step(
            self.global_steps,
            self.global_samples + self.train_batch_size(),  # train_batch adds it after
            self.get_lr()[0] if self.optimizer else 0.0,
            self.loss_scaler.loss_scale if self.loss_scaler else None,
            self._global_grad_norm,
        )

    @property
    def _comm_device(self) -> torch.device:
        """Where this engine's own collective tensors live (NCCL: the accelerator)."""
        return comm.collective_device(self.layout.pipe)

    # -- losses --
    def _loss_sum(self) -> torch.Tensor | None:
        """Upstream's total_loss: the last stage's sum of the batch's micro-batch losses
        (scalars: the forward pass refuses any other loss)."""
        return torch.stack(self._losses).sum() if self._losses else None

    def _mean_over_data(self, values: list[Any], m: int) -> Any:
        if not values:
            return None
        if isinstance(values[0], torch.Tensor):
            total = torch.stack([v.float() for v in values]).sum(0) / m
            comm.all_reduce(total, group=self.layout.data)
            return total / self.dp_world_size
        return [self._mean_over_data([v[i] for v in values], m) for i in range(len(values[0]))]

    def _from_last_stage(self, value: torch.Tensor | None) -> torch.Tensor:
        """The last stage's scalar on every stage of this pipeline (a loss: the forward
        pass refuses a loss_fn that returns anything else)."""
        t = torch.zeros((), device=self._comm_device)
        if value is not None:
            t.copy_(value.detach().reshape(()))
        comm.group_broadcast(t, self.layout.pipe, self._loss_stage)
        return t


__all__ = ["PipeAborted", "PipelineEngine", "PipelineError"]
