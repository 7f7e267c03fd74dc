"""Sparse attention in today's Hugging Face BERT: SparseAttentionUtils swaps each layer's
self-attention for BertSparseSelfAttention (trained q/k/v kept). The swapped model equals the
original given the layout as its attention mask, and trains the same."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from deepspeed.ops.sparse_attention import (
    BertSparseSelfAttention,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionUtils,
)

transformers = pytest.importorskip("transformers")

BS, SEQ, HEADS = 16, 64, 4


def tiny_bert(impl: str = "eager"):
    cfg = transformers.BertConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (4, SEQ), generator=g)
    pad = torch.ones(4, SEQ, dtype=torch.long)
    pad[1, -20:] = 0
    labels = torch.randint(0, 3, (4,), generator=g)
    return ids, pad, labels


def layout_mask(config, pad: torch.Tensor) -> torch.Tensor:
    """The layout and the padding as one additive [b, 1, s, s] mask for the dense model."""
    lay = config.make_layout(SEQ)[0].repeat_interleave(BS, 0).repeat_interleave(BS, 1).bool()
    keep = lay[None, None] & pad.bool()[:, None, None, :]
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_dense_layout_changes_nothing(impl):
    dense = tiny_bert(impl).eval()
    sparse = SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        copy.deepcopy(dense), SEQ, DenseSparsityConfig(HEADS, BS)
    )
    assert isinstance(sparse.bert.encoder.layer[0].attention.self, BertSparseSelfAttention)
    ids, pad, _ = inputs()
    torch.testing.assert_close(
        sparse(ids, attention_mask=pad).logits, dense(ids, attention_mask=pad).logits
    )


def test_a_sparse_bert_trains_like_the_dense_model_masked_by_its_layout():
    config = FixedSparsityConfig(HEADS, BS, num_local_blocks=2)
    dense = tiny_bert()
    sparse = SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        copy.deepcopy(dense), SEQ, config
    )
    ids, pad, labels = inputs()
    mask = layout_mask(config, pad)
    losses = {}
    for name, model, m in (("sparse", sparse, pad), ("dense", dense, mask)):
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses[name] = []
        for _ in range(30):
            loss = model(ids, attention_mask=m, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(float(loss.detach()))
    assert losses["sparse"][-1] < 0.5 * losses["sparse"][0], losses["sparse"]
    for a, b in zip(losses["sparse"], losses["dense"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (losses["sparse"], losses["dense"])


def test_padding_to_the_block_and_back():
    model = tiny_bert()
    ids = torch.randint(1, 40, (2, 50))
    pad_len, ids_p, mask_p, tt_p, pos_p, emb_p = SparseAttentionUtils.pad_to_block_size(
        BS, ids, None, torch.zeros_like(ids), None, None, 0, model.bert.embeddings.word_embeddings
    )
    assert pad_len == 14 and ids_p.shape == (2, 64) and mask_p.shape == (2, 64)
    assert (ids_p[:, 50:] == 0).all() and (mask_p[:, 50:] == 0).all() and mask_p[:, :50].all()
    assert tt_p.shape == (2, 64) and pos_p is None and emb_p is None
    out = torch.randn(2, 64, 8)
    assert torch.equal(SparseAttentionUtils.unpad_sequence_output(pad_len, out), out[:, :50])
    emb = torch.randn(2, 50, 32)
    _, _, _, _, _, emb_p = SparseAttentionUtils.pad_to_block_size(
        BS, None, None, None, None, emb, 0, model.bert.embeddings.word_embeddings
    )
    assert emb_p.shape == (2, 64, 32)
    assert torch.equal(
        emb_p[:, 50:], model.bert.embeddings.word_embeddings(torch.zeros(2, 14).long())
    )


def _roberta_config() -> Any:
    """A tiny RoBERTa for SEQ positions (its table has 2 more rows: padding_idx + 1)."""
    return transformers.RobertaConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ + 2,
    )


def test_longer_position_embeddings_repeat_the_trained_ones():
    model = tiny_bert()
    old = model.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 3 * SEQ)
    new = model.bert.embeddings.position_embeddings.weight
    assert new.shape == (3 * SEQ, 32) and model.config.max_position_embeddings == 3 * SEQ
    assert torch.equal(new[SEQ : 2 * SEQ], old) and torch.equal(new[:SEQ], old)
    ids = torch.randint(1, 40, (1, 2 * SEQ))
    assert model(ids).logits.shape == (1, 3)  # the longer sequence runs
    cfg = _roberta_config()
    rob = transformers.RobertaModel(cfg)
    old = rob.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(rob, 2 * SEQ)
    new = rob.embeddings.position_embeddings.weight
    assert new.shape == (2 * SEQ + 2, 32)  # RoBERTa's padding offset kept once
    assert torch.equal(new[:2], old[:2]) and torch.equal(new[SEQ + 2 :], old[2:])


def test_an_extended_sparse_roberta_saves_and_loads(tmp_path):
    """extend_position_embedding then replace_...: the config keeps counting the table's
    2 offset rows (it was cut to the positions, and from_pretrained refused the table)."""
    cfg = _roberta_config()
    rob = transformers.RobertaForMaskedLM(cfg)
    SparseAttentionUtils.extend_position_embedding(rob, 2 * SEQ)
    sparse = FixedSparsityConfig(num_heads=4, block=16)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        rob, 2 * SEQ, sparse
    )
    assert rob.config.max_position_embeddings == 2 * SEQ + 2
    assert rob.roberta.embeddings.position_embeddings.weight.shape[0] == 2 * SEQ + 2
    ids = torch.randint(3, 40, (1, 2 * SEQ))
    assert rob(ids).logits.shape == (1, 2 * SEQ, 40)  # the sparse layers take 2 * SEQ
    rob.save_pretrained(tmp_path)
    again = transformers.RobertaForMaskedLM.from_pretrained(tmp_path)
    assert again.config.max_position_embeddings == 2 * SEQ + 2


def test_tokenizer_length_and_bad_models():
    class Tok:
        model_max_length = 512
        init_kwargs: dict = {}

    tok = SparseAttentionUtils.update_tokenizer_model_max_length(Tok(), 4096)
    assert tok.model_max_length == 4096 and tok.init_kwargs["model_max_length"] == 4096
    with pytest.raises(ValueError, match="neither a BERT nor a RoBERTa model"):
        SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
            torch.nn.Linear(2, 2), 128
        )
    with pytest.raises(ValueError, match="num_heads=2 but the model has num_attention_heads=4"):
        BertSparseSelfAttention(tiny_bert().config, FixedSparsityConfig(2, BS))
    odd = tiny_bert().config
    odd.max_position_embeddings = 40
    with pytest.raises(ValueError, match="config.max_position_embeddings=40 is not a multiple"):
        BertSparseSelfAttention(odd, FixedSparsityConfig(HEADS, BS))


def test_each_mask_form_masks_the_same_keys():
    """A [b, s] floating mask is additive, as upstream passes it on (an all-zero one masks
    nothing); a tokenizer's integer or bool 0/1 mask marks the keys to attend; HF's extended
    [b, 1, 1, s] is additive."""
    torch.manual_seed(0)
    cfg = tiny_bert().config
    att = BertSparseSelfAttention(cfg, FixedSparsityConfig(HEADS, BS))
    x = torch.randn(2, SEQ, 32)
    keep = torch.ones(2, SEQ, dtype=torch.long)
    keep[0, 40:] = 0
    add = (1.0 - keep.float()) * -10000.0
    want = att(x, add[:, None, None, :])
    assert not torch.allclose(want, att(x))
    torch.testing.assert_close(att(x, add), want)
    torch.testing.assert_close(att(x, keep), want)
    torch.testing.assert_close(att(x, keep.bool()), want)
    torch.testing.assert_close(att(x, torch.zeros(2, SEQ)), att(x))
