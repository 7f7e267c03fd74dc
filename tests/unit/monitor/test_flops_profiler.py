"""The FLOPs profiler against hand formulas, upstream's published LeNet-5 profile, and the
dispatcher's own count of what the backward runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_ext.monitor.flops_profiler import FlopsProfiler, get_model_profile
from tests.helpers.distributed import run_ranks


class LeNet5(nn.Module):
    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(1, 6, 5),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Conv2d(16, 120, 5),
            nn.Tanh(),
        )
        self.classifier = nn.Sequential(nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, n_classes))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.classifier(torch.flatten(self.feature_extractor(x), 1))
        return logits, F.softmax(logits, dim=1)


def test_lenet5_matches_upstreams_published_profile_and_repeats_exactly() -> None:
    model = LeNet5()
    first = get_model_profile(model, (1024, 1, 32, 32), print_profile=False, as_string=False)
    assert first == (866_076_672, 426_516_480, 61_706)
    again = get_model_profile(model, (1024, 1, 32, 32), print_profile=False, as_string=False)
    assert again == first  # each profile starts from zero (upstream's accumulate)
    assert get_model_profile(model, (1024, 1, 32, 32), print_profile=False) == (
        "866.08 M",
        "426.52 MMACs",
        "61.71 k",
    )


class GPTBlock(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _hand(b: int, s: int, gemm_weights: int, h: int) -> int:
    """2 FLOPs per multiply-add over the weight GEMMs, plus QK^T and PV (2 * 2 * b*s*s*h)."""
    return 2 * b * s * gemm_weights + 4 * b * s * s * h


def _close(counted: int, hand: int) -> None:
    assert abs(counted - hand) / hand < 0.01, (counted, hand)


def test_gpt_layer_within_one_percent_of_the_hand_count() -> None:
    b, s, h = 2, 64, 256
    flops, macs, _ = get_model_profile(
        GPTBlock(h, 4), (b, s, h), print_profile=False, as_string=False
    )
    _close(flops, _hand(b, s, 12 * h * h, h))
    assert macs == b * s * 12 * h * h + 2 * b * s * s * h  # the products alone, exactly


def test_bert_and_llama_layers_within_one_percent_of_the_hand_count() -> None:
    transformers = pytest.importorskip("transformers")
    b, s, h, inter = 2, 64, 128, 512
    bert_cfg = transformers.BertConfig(
        hidden_size=h, num_attention_heads=4, intermediate_size=inter, attn_implementation="sdpa"
    )
    bert = transformers.models.bert.modeling_bert.BertLayer(bert_cfg).eval()
    flops, _, _ = get_model_profile(bert, (b, s, h), print_profile=False, as_string=False)
    _close(flops, _hand(b, s, 4 * h * h + 2 * h * inter, h))

    kv_heads, heads = 2, 4
    llama_cfg = transformers.LlamaConfig(
        hidden_size=h,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        attn_implementation="sdpa",
    )
    llama = transformers.models.llama.modeling_llama
    layer = llama.LlamaDecoderLayer(llama_cfg, layer_idx=0).eval()
    rope = llama.LlamaRotaryEmbedding(llama_cfg)
    x = torch.randn(b, s, h)
    pos = rope(x, torch.arange(s).unsqueeze(0))
    flops, _, _ = get_model_profile(
        layer,
        kwargs={"hidden_states": x, "position_embeddings": pos, "attention_mask": None},
        print_profile=False,
        as_string=False,
    )
    kv = h * kv_heads // heads
    _close(flops, _hand(b, s, 2 * h * h + 2 * h * kv + 3 * h * inter, h))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def test_backward_is_counted_as_it_runs_recompute_included() -> None:
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(32, 64)  # no gradient wanted for the input: its product is skipped
    first = 2 * 32 * 64 * 256
    gemm = 2 * first  # the forward's two products

    def measured(recompute: bool) -> tuple[int, int]:
        model = _mlp()
        prof = FlopsProfiler(model)
        prof.start_profile()
        with prof.count_forward_dispatch():
            out = checkpoint(model, x, use_reentrant=False) if recompute else model(x)
        prof.stop_profile()
        with prof.count_backward():
            out.sum().backward()
        assert prof.bwd is not None
        return prof.fwd_dispatch.flops, prof.bwd.flops

    fwd, bwd = measured(False)
    # two weight gradients and one input gradient (the first layer's is not needed): not the
    # 2x of the forward a formula would assume
    assert (fwd, bwd) == (gemm, 3 * first)
    fwd_r, bwd_r = measured(True)
    # the recomputed forward is in the backward, as far as it ran: torch's checkpoint stops
    # once the last saved tensor (the ReLU's output) is back, before the second product
    assert fwd_r == gemm and bwd_r == bwd + first


def test_profile_text_has_summary_aggregate_and_tree(tmp_path: Path) -> None:
    out = tmp_path / "p" / "profile.txt"
    get_model_profile(LeNet5(), (8, 1, 32, 32), module_depth=1, top_modules=2, output_file=str(out))
    text = out.read_text()
    assert "Profile Summary at step 1:" in text
    assert re.search(r"params per GPU:\s+61.71 k", text)
    assert re.search(r"achieved FLOPS per GPU / peak:\s+[\d.]+% of .*measured fp32 GEMM peak", text)
    depths = re.findall(r"^depth (\d+):", text, re.M)
    assert depths == ["0", "1"]  # module_depth=1
    assert "(feature_extractor): Sequential(" in text
    assert re.search(r"\(0\): Conv2d\(156, 0.25% Params, 940.8 KMACs", text)


def test_ignored_modules_count_toward_their_parent() -> None:
    model = _mlp()
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(torch.randn(4, 64))
    prof.stop_profile()
    assert set(prof.stats) == {model, model[1]}  # the root and the ReLU
    assert prof.get_total_macs() == 4 * (64 * 256 + 256 * 64)
    prof.end_profile()


def test_einsum_with_an_implicit_output_counts_as_the_explicit_one() -> None:
    """'ij,jk,kl' dropped the output letters after the first contraction (90 MACs where
    'ij,jk,kl->il' counts the right 150)."""
    from deepspeed_ext.monitor.flops_profiler.formulas import einsum

    a, b, c = torch.ones(2, 3), torch.ones(3, 5), torch.ones(5, 4)
    assert einsum("ij,jk,kl", a, b, c) == einsum("ij,jk,kl->il", a, b, c) == (140, 70)


@pytest.mark.parametrize("kind, gates", [("LSTM", 4), ("GRU", 3), ("RNN", 1)])
def test_recurrent_layers_count_every_weight_matrix_per_step(kind: str, gates: int) -> None:
    """nn.LSTM/GRU/RNN counted 0 (torch's counter does not see them on a CPU): each weight
    matrix multiplies one vector per time step and sequence, per layer and direction."""
    m = getattr(torch.nn, kind)(8, 16, num_layers=2, bidirectional=True)
    _, macs, _ = get_model_profile(m, input_shape=(5, 3, 8), print_profile=False, as_string=False)
    rows, h = 5 * 3, 16
    per_direction = gates * h * (8 + h) + gates * h * (2 * h + h)  # layer 2 reads both ways
    assert macs == rows * 2 * per_direction


def test_bad_calls_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="either input_shape or args"):
        get_model_profile(_mlp(), (4, 64), args=[torch.randn(4, 64)])
    with pytest.raises(ValueError, match="give input_shape, or the model's inputs"):
        get_model_profile(_mlp())
    a, b = FlopsProfiler(_mlp()), FlopsProfiler(_mlp())
    a.start_profile()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            b.start_profile()
    finally:
        a.end_profile()
    assert FlopsProfiler(_mlp()).get_total_flops() == 0


def _engine_profile(out_dir: str) -> dict:
    from deepspeed_ext.runtime.initialize import initialize

    torch.manual_seed(0)
    model = _mlp()
    out = f"{out_dir}/rank{os.environ['RANK']}.txt"
    engine, *_ = initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": out},
        },
    )
    for _ in range(3):
        for _ in range(2):
            engine.backward(engine(torch.randn(8, 64)).square().mean())
            engine.step()
    return {
        "profiler": engine.flops_profiler is not None,
        "flops": engine.flops_profiler.flops if engine.flops_profiler else None,
        "written": Path(out).exists(),
        "text": Path(out).read_text() if Path(out).exists() else "",
    }


def test_the_engine_profiles_the_configured_step_on_rank_zero(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_engine_profile, 2, str(tmp_path), timeout=120)
    assert r1 == {"profiler": False, "flops": None, "written": False, "text": ""}
    assert r0["profiler"] and r0["written"]
    one_forward = get_model_profile(_mlp(), (8, 64), print_profile=False, as_string=False)[0]
    assert r0["flops"] == 2 * one_forward  # both micro-batches of the step
    text = r0["text"]
    assert "Profile Summary at step 1:" in text
    assert re.search(r"micro-batches in the profiled step .*:\s+2", text)
    assert re.search(r"forward passes profiled:\s+2", text)
    # the backward's products: both weight gradients, and the input gradient of the second
    # layer only (the batch needs none): 1.5x the forward's, counted, not assumed 2x
    assert re.search(r"bwd / fwd flops of the matrix ops .*:\s+1.50", text), text
    for row in ("bwd latency", "step latency", "iter latency", "samples/second"):
        assert re.search(rf"^{row}:\s+\S", text, re.M), row


def _first_profile_latency(out: str) -> str:
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(
        model=_mlp(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "Adam", "params": {"lr": 0.1}},  # never runs the counter
            "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": out},
        },
    )
    for _ in range(3):
        engine.backward(engine(torch.randn(8, 64)).square().mean())
        engine.step()
    return re.search(r"^fwd latency:\s+(.*)$", Path(out).read_text(), re.M).group(1).strip()


def test_the_profiled_forward_latency_leaves_out_the_counters_set_up(tmp_path: Path) -> None:
    """torch's FlopCounterMode takes about 1 s to set itself up at its first op; inside the
    timed forward it made a 64x64 MLP's forward latency 1 s and samples/s 3 (a fresh
    process, an optimizer that never ran the counter before). The bound has 30x room."""
    (latency,) = run_ranks(_first_profile_latency, 1, str(tmp_path / "p.txt"), timeout=120)
    value, unit = latency.split()
    assert unit in ("us", "ms") and (unit == "us" or float(value) < 500), latency


def _pipeline_profile(out: str) -> str:
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss)
    engine, *_ = initialize(
        model=net,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
            "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": out},
        },
    )
    data = iter([(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(6)])
    for _ in range(3):
        engine.train_batch(data_iter=data)
    return Path(out).read_text() if Path(out).exists() else ""


def test_a_pipeline_profile_counts_its_stage_not_the_stages_times_it(tmp_path: Path) -> None:
    """The model parallel size was the stage count, so 'params of model' was stage 0's
    params times 2 (288 for a 161-parameter model)."""
    text = run_ranks(_pipeline_profile, 2, str(tmp_path / "p.txt"), timeout=120)[0]
    assert re.search(r"^model parallel size:\s+1$", text, re.M), text
    assert re.search(r"^pipeline stages .*:\s+2$", text, re.M), text
    assert re.search(r"^params of stage = params per GPU \* mp_size:\s+144$", text, re.M), text
