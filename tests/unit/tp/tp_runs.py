"""Rank functions for the AutoTP training tests: tiny Hugging Face models built from configs
(random weights), trained sliced on real gloo ranks and compared with the same model trained
whole in one process on the same global batch."""

from __future__ import annotations

import os
from typing import Any

import torch

STEPS = 3
MICRO = 2
SEQ = 8
VOCAB = 64


def _causal_lm(family: str, seed: int, **extra: Any) -> torch.nn.Module:
    """A tiny Hugging Face causal LM of `family` ("Llama", "Gemma", "Phi3") from a config."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        attn_implementation="eager",
        **extra,
    )
    return getattr(transformers, f"{family}ForCausalLM")(cfg)


def llama(seed: int = 0, kv_heads: int = 2, tied: bool = False) -> torch.nn.Module:
    return _causal_lm("Llama", seed, num_key_value_heads=kv_heads, tie_word_embeddings=tied)


def llama_tied(seed: int = 0) -> torch.nn.Module:
    return llama(seed, tied=True)


def gpt2(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(cfg)


def gemma(seed: int = 0) -> torch.nn.Module:
    """Its embedding scales what it looks up (sqrt(hidden)): a forward of its own that a
    vocabulary cut must keep; no preset, so the model's own tp_plan cuts it."""
    return _causal_lm("Gemma", seed, num_key_value_heads=2, head_dim=8)


def phi3(seed: int = 0) -> torch.nn.Module:
    """A fused q/k/v projection whose output its attention splits at the config's head
    counts."""
    return _causal_lm("Phi3", seed, num_key_value_heads=2, pad_token_id=0)


MODELS = {"llama": llama, "gpt2": gpt2, "llama_tied": llama_tied, "gemma": gemma, "phi3": phi3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def tokens(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def reference(
    name: str, dp: int, clip: float, lr: float = 0.1, dtype: torch.dtype = torch.float32
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(losses, grad norms, final weights) of the whole model, one process, SGD, the global
    batch of `dp` data-parallel ranks per step."""
    model = MODELS[name]().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(STEPS):
        ids = torch.cat([tokens(step, r) for r in range(dp)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        norms.append(float(total))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def full_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's module state with every sliced weight made whole (all-gather over the
    tensor group)."""
    from deepspeed_ext import comm

    tensor = engine.layout.tensor
    out = {}
    for name, p in engine.module.named_parameters():
        spec = getattr(p, "ds_tensor_slice", None)
        value = p.detach().float().contiguous()
        if spec is not None:
            parts = [torch.empty_like(value) for _ in range(tensor.size)]
            comm.all_gather(parts, value, group=tensor)
            value = spec.full(parts)
        out[name] = value
    return out


def train(
    name: str,
    zero: int,
    tp: int,
    clip: float = 0.0,
    precision: str = "fp32",
    via_init: bool = False,
) -> dict:
    """via_init: no tensor_parallel in the config; upstream's older calls instead
    (set_autotp_mode(training=True) and deepspeed.tp_model_init)."""
    import deepspeed

    world = int(os.environ["WORLD_SIZE"])
    dp = world // tp
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": zero},
        "tensor_parallel": {"autotp_size": tp},
        "gradient_clipping": clip,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":  # a small first scale: no overflow-skipped steps to compare
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    model = MODELS[name]()
    if via_init:
        del config["tensor_parallel"]
        deepspeed.set_autotp_mode(training=True)
        dtype = DTYPES[precision]
        model = deepspeed.tp_model_init(model, tp_size=tp, dtype=dtype)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    local = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    losses, norms = [], []
    for step in range(STEPS):
        ids = tokens(step, engine.layout.data.rank)
        loss = engine(input_ids=ids, labels=ids).loss.float()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
    from deepspeed_ext import comm

    mean_losses = []
    for value in losses:  # each data-parallel rank saw its own micro-batch
        t = torch.tensor(
            [value], dtype=torch.float64, device=comm.collective_device(engine.layout.data)
        )
        comm.all_reduce(t, group=engine.layout.data)
        mean_losses.append(float(t) / dp)
    weights = full_weights(engine)
    ref_losses, ref_norms, ref_weights = reference(name, dp, clip, dtype=DTYPES[precision])
    errs = {k: float((weights[k] - ref_weights[k]).abs().max()) for k in weights}
    sliced = sorted(n for n, p in engine.module.named_parameters() if hasattr(p, "ds_tensor_slice"))
    engine.destroy()
    return {
        "losses": mean_losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "max_weight_err": max(errs.values()),
        "worst": max(errs, key=lambda k: errs[k]),
        "full_shapes": full,
        "local_shapes": local,
        "sliced": sliced,
        "tensor_rank": engine.layout.tensor.rank,
        "data_rank": engine.layout.data.rank,
    }


def scenarios(cases: list[tuple]) -> list[dict]:
    """Several trainings in one spawned job (the process group is shared)."""
    return [train(*case) for case in cases]


def expect_error(name: str, tp: int, kv_heads: int = 2) -> str:
    import deepspeed

    model = llama(kv_heads=kv_heads) if name == "llama" else MODELS[name]()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensor_parallel": {"autotp_size": tp},
    }
    try:
        deepspeed.initialize(model=model, config=config)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def copy_to_calls() -> int:
    """How many input all-reduces (copy_to applications) one forward of the sliced 2-layer
    Llama sets up: q/k/v share one, gate/up share one, lm_head has its own."""
    import deepspeed
    from deepspeed_ext.tp import collectives

    config = {"train_micro_batch_size_per_gpu": MICRO, "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = deepspeed.initialize(model=llama(), config=config)
    calls = 0
    real = collectives._CopyTo.apply

    def counting(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args)

    collectives._CopyTo.apply = counting  # type: ignore[method-assign]
    try:
        ids = tokens(0, 0)
        engine(input_ids=ids, labels=ids)
    finally:
        collectives._CopyTo.apply = real  # type: ignore[method-assign]
    engine.destroy()
    return calls


def expect_error_cases() -> list[Any]:
    return [expect_error("llama", 2, kv_heads=1), expect_error("llama", 4), copy_to_calls()]


def replicas_stay_identical() -> float:
    """Ranks seeded differently (as data-parallel scripts often do), dropout on: after a few
    steps every replicated weight is still bitwise the same across the tensor group. Returns
    the largest difference."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import deepspeed
    from deepspeed_ext import comm

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    torch.manual_seed(1234 + int(os.environ["RANK"]))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    for step in range(STEPS):
        ids = tokens(step, 0)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    worst = 0.0
    tensor = engine.layout.tensor
    for p in engine.module.parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        mine = p.detach().clone()
        theirs = mine.clone()
        comm.group_broadcast(theirs, tensor)
        worst = max(worst, float((mine - theirs).abs().max()))
    engine.destroy()
    return worst


def _ckpt_engine(zero: int, tp: int, model: str = "llama") -> Any:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": zero},
        "tensor_parallel": {"autotp_size": tp},
    }
    engine, *_ = deepspeed.initialize(model=MODELS[model](), config=config)
    return engine


def _steps(engine: Any, start: int, stop: int) -> list[float]:
    out = []
    for step in range(start, stop):
        ids = tokens(step, engine.layout.data.rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def ckpt_save(save_dir: str, zero: int, tp: int, model: str = "llama") -> dict:
    """Train 2 steps, save a checkpoint and a 16-bit export, train 2 more (the uninterrupted
    reference for a resume); the export loaded into the plain model gives the same logits."""
    from pathlib import Path

    engine = _ckpt_engine(zero, tp, model)
    _steps(engine, 0, 2)
    engine.save_checkpoint(save_dir, tag="t")
    engine.save_16bit_model(save_dir, "export.bin")
    ids = tokens(9, 0)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float()
    export_err = None
    if int(os.environ["RANK"]) == 0:
        plain = MODELS[model](seed=1)
        state = torch.load(Path(save_dir) / "export.bin", weights_only=True)
        plain.load_state_dict(state)
        with torch.no_grad():
            export_err = float((plain(input_ids=ids).logits - logits).abs().max())
    after = _steps(engine, 2, 4)
    engine.destroy()
    return {"after": after, "export_err": export_err}


def ckpt_resume(save_dir: str, zero: int, tp: int, model: str = "llama") -> list[float]:
    engine = _ckpt_engine(zero, tp, model)
    engine.load_checkpoint(save_dir, tag="t")
    out = _steps(engine, 2, 4)
    engine.destroy()
    return out


def fp32_export_logits(save_dir: str, model: str = "llama") -> float:
    """zero_to_fp32 of a sliced checkpoint loaded into the plain model: its logits against
    the 16-bit export's (fp32 training: the same weights)."""
    from pathlib import Path

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ids = tokens(9, 0)
    a, b = MODELS[model](seed=1), MODELS[model](seed=2)
    a.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t"))
    b.load_state_dict(torch.load(Path(save_dir) / "export.bin", weights_only=True))
    with torch.no_grad():
        return float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max())


# the pipeline tests' blocks sliced: up by columns, down by rows
_UP_DOWN = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
    ],
}


def _pipeline_3d_engine(
    gas: int,
    zero: int,
    dp: int,
    pipeline: dict | None = None,
    v: bool = False,
    checkpointing: dict | None = None,
    pp: int = 2,
    tp: int = 2,
) -> Any:
    """TP `tp` x PP `pp` x DP `dp` on the pipeline tests' tiny GPT (tied embedding and head), its
    blocks' up / down layers sliced by partition_config rules (`v`: as a DualPipeVModule)."""
    from deepspeed_ext.comm.topology import PipeModelDataParallelTopology
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.runtime.pipe import pipe_runs as pr

    module = pr.aux_pipe(  # with an additional loss on the last stage
        pr.specs(),
        topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp),
        loss_fn=pr.lm_loss,
        seed_layers=True,
        partition_method="uniform",
        v=v,
    )
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": pr.MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": pr.CLIP,
        "zero_optimization": {"stage": zero},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp, "partition_config": _UP_DOWN}
    if pipeline is not None:
        cfg["pipeline"] = pipeline
    if checkpointing is not None:
        cfg["activation_checkpointing"] = checkpointing
    engine, *_ = initialize(
        model=module, config=cfg, optimizer=lambda groups: torch.optim.AdamW(groups, lr=pr.LR)
    )
    return engine


def _broadcast_batch(engine: Any) -> Any:
    """Megatron-DeepSpeed's data path: only tensor rank 0 of a data stage reads; the batch
    function (upstream's set_batch_fn) gets None on the others and broadcasts to them."""
    from deepspeed_ext import comm
    from tests.unit.runtime.pipe import pipe_runs as pr

    dev = comm.collective_device(engine.layout.tensor)

    def fn(batch: Any) -> Any:
        if batch is None:
            batch = [torch.empty(pr.MICRO, pr.SEQ, dtype=torch.long) for _ in range(2)]
        batch = tuple(t.to(dev).contiguous() for t in batch)  # as Megatron's .cuda()
        for t in batch:
            comm.group_broadcast(t, engine.layout.tensor, 0)
        return batch

    return fn


def _train_3d(
    engine: Any, steps: int, gas: int, aux: list[float] | None = None, megatron: bool = False
) -> list[float]:
    from tests.unit.runtime.pipe import pipe_runs as pr

    dp_rank = engine.grid.get_data_parallel_id()
    reads = engine._needs_data() and not (megatron and engine.layout.tensor.rank > 0)
    if megatron:
        engine.set_batch_fn(_broadcast_batch(engine))
    losses = []
    for step in range(steps):
        it = iter(pr.batches(step, dp_rank, gas)) if reads else None
        losses.append(float(engine.train_batch(it)))
        if aux is not None:
            aux.append(float(engine.agg_additional_losses["logits_sq"]))
    return losses


def pipeline_3d(steps: int, gas: int, zero: int) -> dict:
    """TP 2 x PP 2 x DP 2, upstream's defaults (activations and gradients partitioned over
    the tensor ranks between stages), data read as Megatron-DeepSpeed does (tensor rank 0,
    broadcast by the batch function): this rank's losses, its stage's weights made whole
    over the tensor group, and whether its channels were split."""
    engine = _pipeline_3d_engine(gas, zero, dp=2)
    aux: list[float] = []
    losses = _train_3d(engine, steps, gas, aux, megatron=True)
    channels = [*engine._act_in.values(), *engine._act_out.values()]
    channels += [*engine._grad_in.values(), *engine._grad_out.values()]
    return {
        "losses": losses,
        "aux": aux,
        "weights": full_weights(engine),
        "sliced": sorted(
            n for n, p in engine.module.named_parameters() if hasattr(p, "ds_tensor_slice")
        ),
        "coords": (engine.stage_id, engine.layout.data.rank, engine.layout.tensor.rank),
        "upstream_attrs": (
            engine.get_pipeline_parallel_rank(),
            engine.is_model_parallel,
            engine.is_pipe_partitioned,
            engine.is_grad_partitioned,
            engine.prev_stage,
            engine.next_stage,
            engine.micro_batch_size,
        ),
        "split": [ch.split is not None for ch in channels],
    }


def _frozen_stage_3d(steps: int, gas: int) -> dict:
    """TP 2 x PP 2, stage 0's layers frozen (untied head), ZeRO 1: its ranks step nothing
    and are sent empty (partitioned) gradient messages; the last stage trains."""
    from deepspeed_ext.comm.topology import PipeModelDataParallelTopology
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule
    from tests.unit.runtime.pipe import pipe_runs as pr

    module = PipelineModule(
        pr.specs(tied=False),
        topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
        loss_fn=pr.lm_loss,
        seed_layers=True,
        partition_method="uniform",
    )
    if module.stage_id == 0:
        module.requires_grad_(False)
    cfg = {
        "train_micro_batch_size_per_gpu": pr.MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": pr.CLIP,
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2, "partition_config": _UP_DOWN},
    }
    engine, *_ = initialize(
        model=module, config=cfg, optimizer=lambda groups: torch.optim.AdamW(groups, lr=pr.LR)
    )
    losses = _train_3d(engine, steps, gas)
    engine.destroy()
    return {"losses": losses, "frozen_layers": module.parts[1]}


def pipeline_split_vs_whole(steps: int, gas: int) -> dict:
    """TP 2 x PP 2 on 4 ranks, trained with pipeline.pipe_partitioned / grad_partitioned on
    (the default) and off: each run's losses and the bytes its point-to-point sends put on
    the link between stages; then with every layer checkpointed and partition_activations
    on; then with stage 0 frozen; then DualPipeV's (partitioned, 4 micro-batches) losses."""
    from deepspeed_ext import comm

    out: dict[str, Any] = {}
    for name, flag in (("split", True), ("whole", False)):
        keys = {"pipe_partitioned": flag, "grad_partitioned": flag}
        engine = _pipeline_3d_engine(gas, 0, dp=1, pipeline=keys)
        comm.comms_logger.configure(enabled=True, prof_all=False, prof_ops=["isend"])
        comm.comms_logger.reset_data()
        losses = _train_3d(engine, steps, gas)
        out[name] = {"losses": losses, "isend_bytes": comm.comms_logger.total_bytes("isend")}
        comm.comms_logger.configure(enabled=False)
        engine.destroy()
    # checkpointing every layer turned on by the config's pipeline key (the module was
    # built without it), with partition_activations: the default checkpoint function keeps
    # 1/tp of each saved input (torch's non-reentrant one would keep them whole)
    from deepspeed_ext.runtime.activation_checkpointing import partition

    engine = _pipeline_3d_engine(
        gas,
        0,
        dp=1,
        pipeline={"activation_checkpoint_interval": 1},
        checkpointing={"partition_activations": True},
    )
    split, parts = partition.split, []

    def counted(t: torch.Tensor, axis: Any) -> Any:
        got = split(t, axis)
        parts.append(isinstance(got, partition.Part))
        return got

    partition.split = counted  # type: ignore[assignment]
    try:
        losses = _train_3d(engine, steps, gas)
    finally:
        partition.split = split  # type: ignore[assignment]
    out["partitioned_ckpt"] = {
        "losses": losses,
        "interval": engine.module.activation_checkpoint_interval,
        "parts": sum(parts),
    }
    engine.destroy()
    out["frozen_stage"] = _frozen_stage_3d(steps, gas)
    engine = _pipeline_3d_engine(4, 0, dp=1, v=True)
    out["dualpipev"] = {
        "losses": _train_3d(engine, steps, 4),
        "split": all(ch.split is not None for ch in [*engine._act_in.values()]),
    }
    return out


class _Mlp(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(dim, 4 * dim)
        self.down_proj = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.nn.functional.gelu(self.up_proj(x)))


def guide_3d_shrunk() -> dict:
    """The guides' 3D config (ZeRO 3 + CPU optimizer offload, pipeline stages, the top-level
    tensor_model_parallel_size) shrunk to 2 stages x 2 slices on 4 ranks, given a plain
    nn.Sequential: it trains (ZeRO 3 runs as stage 2 there) and the loss falls."""
    import deepspeed

    torch.manual_seed(0)
    dim = 16
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, dim), *[_Mlp(dim) for _ in range(4)], torch.nn.Linear(dim, VOCAB)
    )
    model.loss_fn = lambda logits, labels: torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB).float(), labels.reshape(-1)
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,  # the guide's 16, shrunk
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "pipeline_parallelism": {"num_stages": 2},
        "tensor_model_parallel_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(0)
    fixed = [torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(4)]
    losses = []
    for _ in range(6):
        it = iter([(ids, ids) for ids in fixed]) if engine._needs_data() else None
        losses.append(float(engine.train_batch(it)))
    sliced = [n for n, p in engine.module.named_parameters() if hasattr(p, "ds_tensor_slice")]
    return {"losses": losses, "stage": engine.zero_optimization_stage(), "sliced": sliced}


class _CkptNet(torch.nn.Module):
    def __init__(self, dim: int = 16, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList([_Mlp(dim) for _ in range(blocks)])
        self.head = torch.nn.Linear(dim, VOCAB)
        self.checkpointed = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import deepspeed

        x = self.embed(ids)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.checkpointed else block(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))


def partitioned_checkpoints() -> dict:
    """At TP 2: blocks checkpointed with partition_activations (and in one contiguous buffer)
    train exactly as without checkpointing; each rank keeps half of each saved input."""
    import deepspeed
    from deepspeed_ext.runtime.activation_checkpointing import partition

    out: dict[str, Any] = {}
    for mode in ("plain", "partitioned", "contiguous"):
        model = _CkptNet()
        model.checkpointed = mode != "plain"
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "tensor_parallel": {"autotp_size": 2},
        }
        if mode != "plain":
            config["activation_checkpointing"] = {
                "partition_activations": True,
                "contiguous_memory_optimization": mode == "contiguous",
                "number_checkpoints": 3,
            }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        losses = []
        for step in range(STEPS):
            ids = tokens(step, 0)
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[mode] = {"losses": losses, "weights": full_weights(engine)}
        if mode == "contiguous":
            arena = next(iter(partition._arenas.values()))
            out["arena"] = (arena.slots, arena.numel, arena.live)
        engine.destroy()
    deepspeed.checkpointing.reset()
    part = partition.split(torch.randn(MICRO, SEQ, 16), engine.layout.tensor)
    out["part_numel"] = part.data.numel() if isinstance(part, partition.Part) else None
    return out


def restage_3d(root: str) -> dict:
    """4 ranks: TP 2 x PP 2 (ZeRO 1) trains a batch and saves; TP 2 x PP 1 x DP 2 resumes
    (every saved stage's files of its own tensor rank: weights, masters, optimizer state)
    and takes the next batch as the saving run does; TP 1 x PP 2 x DP 2 is refused by name;
    zero_to_fp32 makes every sliced weight whole."""
    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )
    from deepspeed_ext.utils.errors import CheckpointError
    from tests.unit.runtime.pipe import pipe_runs as pr

    def step(engine: Any, s: int) -> float:  # the same 2 micro-batches, over dp ranks
        dp = engine.layout.data
        mbs = pr.batches(s, 0, 2)[dp.rank :: dp.size]
        return float(engine.train_batch(iter(mbs) if engine._needs_data() else None))

    saver = _pipeline_3d_engine(2, 1, dp=1)
    step(saver, 0)
    saver.save_checkpoint(root, tag="t")
    saved = {n: v.clone() for n, v in full_weights(saver).items()}  # this stage's
    cont = step(saver, 1)
    wide = _pipeline_3d_engine(1, 1, dp=2, pp=1)
    wide.load_checkpoint(root, tag="t")
    loaded = {n: v.clone() for n, v in full_weights(wide).items()}
    errs = {n: float((loaded[n] - v).abs().max()) for n, v in saved.items()}
    err = max(errs.values())
    resumed = step(wide, 1)
    refused = ""
    try:
        _pipeline_3d_engine(1, 1, dp=2, tp=1).load_checkpoint(root, tag="t")
    except CheckpointError as e:
        refused = str(e)
    sd = get_fp32_state_dict_from_zero_checkpoint(root, tag="t")
    export = max(float((sd[n] - v).abs().max()) for n, v in saved.items())
    return {
        "loaded_err": err,
        "bad": {n: e for n, e in errs.items() if e},
        "export_err": export,
        "export_names": sorted(sd),
        "loaded_names": sorted(loaded),
        "continued": cont,
        "resumed": resumed,
        "refused": refused,
    }
