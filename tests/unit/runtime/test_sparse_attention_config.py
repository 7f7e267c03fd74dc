"""[Note: sparse attention from the config]: a `sparse_attention` section makes a Hugging Face
BERT's self-attention block-sparse at initialize (the same model as SparseAttentionUtils makes
by hand), keeps SparseSelfAttention modules that already use its layout, and refuses a model
whose layout differs or that has no attention to make sparse."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytest.importorskip("transformers")

SECTION = {"mode": "fixed", "block": 16, "num_local_blocks": 2}


def _config(section: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sparse_attention": section,
    }


class _WithSparseAttention(torch.nn.Module):
    def __init__(self, layout) -> None:
        super().__init__()
        from deepspeed_ext.ops.sparse_attention import SparseSelfAttention

        self.proj = torch.nn.Linear(8, 8)
        self.attn = SparseSelfAttention(layout, max_seq_length=64)


def _scenarios() -> dict:
    from deepspeed_ext.ops.sparse_attention import (
        BertSparseSelfAttention,
        FixedSparsityConfig,
        SparseAttentionUtils,
    )
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.ops.sparse_attention.test_bert import HEADS, SEQ, inputs, tiny_bert

    out: dict = {}
    model = tiny_bert()
    layout = FixedSparsityConfig(num_heads=HEADS, block=16, num_local_blocks=2)
    by_hand = SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        copy.deepcopy(model), SEQ, layout
    )
    engine, *_ = initialize(model=model, config=_config(SECTION))
    out["swapped"] = sum(isinstance(m, BertSparseSelfAttention) for m in engine.module.modules())
    ids, pad, labels = inputs()
    losses = []
    for _ in range(3):  # the engine's steps against the hand-made model's SGD steps
        loss = engine(input_ids=ids, attention_mask=pad, labels=labels).loss
        ref = by_hand(input_ids=ids, attention_mask=pad, labels=labels).loss
        losses.append((float(loss), float(ref)))
        engine.backward(loss)
        engine.step()
        ref.backward()
        with torch.no_grad():
            for p in by_hand.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    out["losses"] = losses

    initialize(model=_WithSparseAttention(layout), config=_config(SECTION))  # kept as is
    for name, model in (
        ("mismatch", _WithSparseAttention(FixedSparsityConfig(num_heads=4, block=16))),
        ("no_attention", torch.nn.Linear(8, 8)),
    ):
        try:
            initialize(model=model, config=_config(SECTION))
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_the_section_makes_attention_sparse_or_is_refused():
    (out,) = run_ranks(_scenarios, 1, timeout=180)
    assert out["swapped"] == 2  # both layers of the tiny BERT
    for ours, ref in out["losses"]:
        assert abs(ours - ref) < 1e-5, out["losses"]
    assert out["losses"][-1][0] < out["losses"][0][0]  # and it trains
    assert "SparseSelfAttention 'attn' uses FixedSparsityConfig(" in out["mismatch"]
    assert "num_local_blocks=4" in out["mismatch"] and "num_local_blocks=2" in out["mismatch"]
    assert "Linear has no self-attention the engine can make sparse" in out["no_attention"]
