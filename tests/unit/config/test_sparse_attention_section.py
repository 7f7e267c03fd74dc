"""The `sparse_attention` section ([Note: sparse attention from the config]): every key set
must shape the chosen mode's layout, the layout it describes is the class built by hand, and
upstream's `DeepSpeedConfig.sparse_attention` dict is there for user code."""

from __future__ import annotations

import pytest

from deepspeed_ext.config import ConfigError, parse
from deepspeed_ext.config.sections.sparse_attention import MODE_KEYS
from deepspeed_ext.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
    sparsity_config_from_dict,
)
from deepspeed_ext.ops.sparse_attention.sparsity_config import same_layout
from deepspeed_ext.runtime.ds_config import DeepSpeedConfig

BY_HAND = {
    "dense": ({"block": 32}, DenseSparsityConfig(num_heads=4, block=32)),
    "fixed": (
        {"num_local_blocks": 2, "attention": "unidirectional", "num_global_blocks": 1},
        FixedSparsityConfig(num_heads=4, num_local_blocks=2, attention="unidirectional"),
    ),
    "variable": (
        {"num_random_blocks": 1, "local_window_blocks": [2, 3], "global_block_indices": [1]},
        VariableSparsityConfig(
            num_heads=4, num_random_blocks=1, local_window_blocks=[2, 3], global_block_indices=[1]
        ),
    ),
    "bigbird": (
        {"num_random_blocks": 2, "num_sliding_window_blocks": 5},
        BigBirdSparsityConfig(num_heads=4, num_random_blocks=2, num_sliding_window_blocks=5),
    ),
    "bslongformer": (
        {"global_block_indices": [0, 4], "global_block_end_indices": [2, 5]},
        BSLongformerSparsityConfig(
            num_heads=4, global_block_indices=[0, 4], global_block_end_indices=[2, 5]
        ),
    ),
}


@pytest.mark.parametrize("mode", sorted(MODE_KEYS))
def test_each_mode_builds_the_layout_its_class_builds_by_hand(mode):
    keys, hand = BY_HAND[mode]
    section = parse({"sparse_attention": {"mode": mode, **keys}}).sparse_attention
    built = sparsity_config_from_dict(section.layout_args(), num_heads=4)
    assert same_layout(built, hand)
    assert built.make_layout(256).equal(hand.make_layout(256))
    # the layout's class and every argument matter
    assert not same_layout(built, FixedSparsityConfig(num_heads=4, block=8))


def test_a_key_the_mode_does_not_use_is_refused_by_name():
    with pytest.raises(ConfigError) as e:
        parse({"sparse_attention": {"mode": "dense", "num_local_blocks": 8, "block": 32}})
    (problem,) = e.value.problems
    assert problem.startswith("sparse_attention.num_local_blocks: mode 'dense' does not use it")
    with pytest.raises(ConfigError, match="num_sliding_window_blocks: mode 'fixed'"):
        parse({"sparse_attention": {"num_sliding_window_blocks": 2}})  # fixed by default
    # the effective config writes every key out at its default: it parses again
    cfg = parse({"sparse_attention": {"mode": "dense", "block": 32}})
    assert parse(cfg.to_dict()).sparse_attention == cfg.sparse_attention


def test_tensor_slicing_and_a_layout_over_every_head_are_refused_together():
    with pytest.raises(ConfigError, match="sparse_attention with tensor_parallel.autotp_size"):
        parse({"sparse_attention": {"mode": "fixed"}, "tensor_parallel": {"autotp_size": 2}})


def test_upstreams_config_object_gives_the_parsed_section():
    ds = DeepSpeedConfig(
        {"train_batch_size": 4, "sparse_attention": {"mode": "bslongformer", "block": 32}}
    )
    assert ds.sparse_attention == {
        "mode": "bslongformer",
        "block": 32,
        "different_layout_per_head": False,
        "num_sliding_window_blocks": 3,
        "global_block_indices": [0],
        "global_block_end_indices": None,
        "attention": "bidirectional",
    }
    assert DeepSpeedConfig({"train_batch_size": 4}).sparse_attention is None
