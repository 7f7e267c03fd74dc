"""DeepSpeedTransformerConfig as upstream builds it (defaults, from_dict, from_json_file) and
every bad input named with its fix."""

from __future__ import annotations

import json

import pytest
import torch

from deepspeed_ext.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer


def cfg(**kw) -> DeepSpeedTransformerConfig:
    base = dict(
        batch_size=2,
        hidden_size=16,
        heads=2,
        attn_dropout_ratio=0.0,
        hidden_dropout_ratio=0.0,
        num_hidden_layers=1,
        initializer_range=0.02,
    )
    return DeepSpeedTransformerConfig(**{**base, **kw})


def test_upstream_defaults_and_from_dict_and_json(tmp_path):
    c = cfg()
    assert c.intermediate_size == 64 and c.layer_norm_eps == 1e-12 and c.pre_layer_norm
    d = {"hidden_size": 8, "heads": 2, "pre_layer_norm": False, "seed": 3}
    c2 = DeepSpeedTransformerConfig.from_dict(d)
    assert (c2.hidden_size, c2.intermediate_size, c2.pre_layer_norm, c2.seed) == (8, 32, False, 3)
    f = tmp_path / "layer.json"
    f.write_text(json.dumps(d), encoding="utf-16")  # upstream's encoding
    assert DeepSpeedTransformerConfig.from_json_file(f).hidden_size == 8
    f.write_text(json.dumps(d))
    assert DeepSpeedTransformerConfig.from_json_file(f).heads == 2
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['hiden_size'\]"):
        DeepSpeedTransformerConfig.from_dict({"hiden_size": 8})


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(hidden_size=18, heads=4), r"hidden_size=18: must be divisible by heads=4"),
        (dict(heads=-1), r"heads=-1: must be a positive int"),
        (dict(attn_dropout_ratio=-1), r"attn_dropout_ratio=-1: must be in \[0, 1\)"),
        (dict(hidden_dropout_ratio=1.0), r"hidden_dropout_ratio=1.0: must be in \[0, 1\)"),
        (dict(batch_size=0), r"batch_size=0: must be > 0"),
        (dict(initializer_range=-1), r"initializer_range=-1: set the std"),
    ],
)
def test_bad_configs_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedTransformerLayer(cfg(**kw))


def test_bad_inputs_are_named():
    layer = DeepSpeedTransformerLayer(cfg())
    with pytest.raises(ValueError, match=r"batch 3 exceeds the config's batch_size=2"):
        layer(torch.randn(3, 4, 16))
    with pytest.raises(
        ValueError, match=r"hidden_states has shape \(2, 4, 8\); expected \[batch, seq, 16\]"
    ):
        layer(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="float16 but config.fp16=False"):
        layer(torch.randn(2, 4, 16).half())
    with pytest.raises(ValueError, match="bfloat16 but the parameters are torch.float32"):
        layer(torch.randn(2, 4, 16).bfloat16())
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 2, 4, 4\)"):
        layer(torch.randn(2, 4, 16), torch.zeros(2, 2, 4, 4))
    with pytest.raises(ValueError, match=r"\['head_mask', 'output_attentions'\] not supported"):
        layer(torch.randn(2, 4, 16), head_mask=torch.ones(2), output_attentions=True)
    with pytest.raises(ValueError, match="config.fp16=True but hidden_states is torch.float32"):
        DeepSpeedTransformerLayer(cfg(fp16=True))(torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match="initial_weights has 3 tensors; expected 8"):
        DeepSpeedTransformerLayer(cfg(), initial_weights=[torch.zeros(16, 16)] * 3)


def test_bool_masks_mean_attend_where_true():
    layer = DeepSpeedTransformerLayer(cfg())
    x = torch.randn(2, 4, 16)
    keep = torch.tensor([[True, True, False, True], [True, True, True, True]])
    additive = torch.zeros(2, 4).masked_fill(~keep, float("-inf"))
    assert torch.equal(layer(x, keep), layer(x, additive))
    # a masked key changes nothing it would not change: perturb it, row 0's output holds
    y = x.clone()
    y[0, 2] += 1.0
    torch.testing.assert_close(layer(y, keep)[0, [0, 1, 3]], layer(x, keep)[0, [0, 1, 3]])


def test_grads_hook_collects_upstreams_names():
    layer = DeepSpeedTransformerLayer(cfg())
    grads: list = []
    layer(torch.randn(2, 4, 16), grads=grads).sum().backward()
    names = {n for _, n in grads}
    assert {"Q_W", "K_W", "V_W", "Q_B", "O_W", "N2_W", "int_W", "out_B", "norm_W"} <= names
    assert all(g.shape[0] == 16 for g, n in grads if n in ("Q_W", "K_B"))
    assert len(grads) == 16  # 12 parameters, q/k/v weights and biases apart
    again: list = []
    layer(torch.randn(2, 4, 16), grads=again).sum().backward()
    layer(torch.randn(2, 4, 16)).sum().backward()  # no grads list: no hooks left behind
    assert len(again) == 16 and len(grads) == 16
