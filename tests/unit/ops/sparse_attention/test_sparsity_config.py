"""Each sparsity pattern against layouts written out by hand from its definition (block rows
attend to block columns), plus the random blocks' rules and the configs' checks."""

from __future__ import annotations

import pytest
import torch

from deepspeed.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

B = 16  # block size


def rows(*r: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in line] for line in r], dtype=torch.int64)


CASES = {
    # windows [0,1] [2,3] [4]; global blocks: the last of each window (1, 3) and of the short
    # last window (4), attended by every row
    "fixed-bi": (
        FixedSparsityConfig(2, B, num_local_blocks=2, num_global_blocks=1),
        5,
        rows("11011", "11011", "01111", "01111", "01011"),
    ),
    # the same, causal: a global column from its own row down
    "fixed-uni": (
        FixedSparsityConfig(1, B, num_local_blocks=2, attention="unidirectional"),
        5,
        rows("10000", "11000", "01100", "01110", "01011"),
    ),
    # global blocks 1 and 3 also attend to everything
    "fixed-horizontal": (
        FixedSparsityConfig(1, B, num_local_blocks=2, horizontal_global_attention=True),
        4,
        rows("1101", "1111", "0111", "1111"),
    ),
    # windows of 1, then 2 repeated: [0] [1,2] [3,4] [5]; column 0 global
    "variable": (
        VariableSparsityConfig(1, B, local_window_blocks=[1, 2]),
        6,
        rows("100000", "111000", "111000", "100110", "100110", "100001"),
    ),
    # blocks [2, 4) global in both directions, windows of 4
    "variable-ranges": (
        VariableSparsityConfig(
            1,
            B,
            local_window_blocks=[4],
            global_block_indices=[2],
            global_block_end_indices=[4],
            horizontal_global_attention=True,
        ),
        6,
        rows("111100", "111100", "111111", "111111", "001111", "001111"),
    ),
    # window of 3 around each row; block 0 global both ways
    "bigbird-bi": (
        BigBirdSparsityConfig(1, B, num_random_blocks=0),
        5,
        rows("11111", "11100", "11110", "10111", "10011"),
    ),
    "bigbird-uni": (
        BigBirdSparsityConfig(1, B, num_random_blocks=0, attention="unidirectional"),
        5,
        rows("10000", "11000", "11100", "10110", "10011"),
    ),
    "longformer": (
        BSLongformerSparsityConfig(1, B, global_block_indices=[2]),
        5,
        rows("11100", "11100", "11111", "00111", "00111"),
    ),
    "local-uni": (LocalSlidingWindowSparsityConfig(1, B), 4, rows("1000", "1100", "0110", "0011")),
    "local-bi": (
        LocalSlidingWindowSparsityConfig(1, B, attention="bidirectional"),
        4,
        rows("1100", "1110", "0111", "0011"),
    ),
    "dense": (DenseSparsityConfig(3, B), 3, torch.ones(3, 3, dtype=torch.int64)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_its_definition(name):
    config, blocks, want = CASES[name]
    layout = config.make_layout(blocks * B)
    assert layout.dtype == torch.int64 and layout.shape == (config.num_heads, blocks, blocks)
    for h in range(config.num_heads):  # one layout, copied to every head
        assert torch.equal(layout[h], want), f"{name} head {h}:\n{layout[h]}"


def test_fixed_heads_take_different_global_patterns():
    config = FixedSparsityConfig(
        3,
        B,
        different_layout_per_head=True,
        num_local_blocks=2,
        num_different_global_patterns=2,
    )
    layout = config.make_layout(4 * B)
    assert torch.equal(layout[0], rows("1101", "1101", "0111", "0111"))  # last of each window
    assert torch.equal(layout[1], rows("1110", "1110", "1011", "1011"))  # first of each
    assert torch.equal(layout[2], layout[0])  # pattern 2 % 2 == 0


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_random_blocks_follow_the_seed_and_the_direction(attention):
    def random_only(seed, h=0):
        c = VariableSparsityConfig(2, B, True, num_random_blocks=3, attention=attention, seed=seed)
        return c.set_random_layout(h, c.setup_layout(8 * B))[h]

    a = random_only(0)
    counts = a.sum(1)
    if attention == "bidirectional":
        assert counts.tolist() == [3] * 8
    else:  # only past blocks: row r has min(3, r + 1)
        assert counts.tolist() == [min(3, r + 1) for r in range(8)]
        assert torch.equal(a, torch.tril(a))
    assert torch.equal(a, random_only(0))  # every rank, every run
    assert not torch.equal(a, random_only(1))
    assert not torch.equal(a, random_only(0, h=1))  # heads draw their own


def test_unidirectional_layouts_never_look_ahead():
    for config in (
        FixedSparsityConfig(2, B, True, 4, 1, "unidirectional", False, 4),
        VariableSparsityConfig(2, B, True, 2, [3], [0, 5], attention="unidirectional"),
        BigBirdSparsityConfig(2, B, True, 2, 3, 2, "unidirectional"),
        BSLongformerSparsityConfig(2, B, True, 5, [3], attention="unidirectional"),
        LocalSlidingWindowSparsityConfig(2, B, 5),
    ):
        layout = config.make_layout(12 * B)
        assert torch.equal(layout, torch.tril(layout)), type(config).__name__
        assert (layout.sum(-1) > 0).all()  # every block row attends to something


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: FixedSparsityConfig(1, B, num_local_blocks=4, num_global_blocks=3), "multiple"),
        (
            lambda: FixedSparsityConfig(1, B, num_different_global_patterns=2),
            "needs different_layout_per_head=True",
        ),
        (
            lambda: FixedSparsityConfig(2, B, True, 4, 2, num_different_global_patterns=3),
            r"must be in \[1, num_local_blocks / num_global_blocks = 2\]",
        ),
        (
            lambda: FixedSparsityConfig(
                1, B, attention="unidirectional", horizontal_global_attention=True
            ),
            "horizontal_global_attention needs attention='bidirectional'",
        ),
        (lambda: VariableSparsityConfig(1, B, attention="causal"), "attention='causal'"),
        (
            lambda: VariableSparsityConfig(
                1, B, global_block_indices=[0, 4], global_block_end_indices=[2]
            ),
            "has 1 entries but global_block_indices has 2",
        ),
        (
            lambda: BSLongformerSparsityConfig(
                1, B, global_block_indices=[3], global_block_end_indices=[3]
            ),
            r"\[3, 3\): the start must be below the end",
        ),
    ],
)
def test_bad_configs_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_lengths_are_named():
    with pytest.raises(
        ValueError, match="sequence length 40 is not a multiple of the block size 16"
    ):
        FixedSparsityConfig(1, B).make_layout(40)
    with pytest.raises(ValueError, match="num_sliding_window_blocks=5 exceeds the 4 blocks"):
        BigBirdSparsityConfig(1, B, num_sliding_window_blocks=5).make_layout(4 * B)
    with pytest.raises(ValueError, match="num_random_blocks=5 exceeds the 4 blocks"):
        VariableSparsityConfig(1, B, num_random_blocks=5).make_layout(4 * B)
    with pytest.raises(NotImplementedError, match="SparsityConfig defines no pattern"):
        SparsityConfig(1, B).make_layout(4 * B)


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (VariableSparsityConfig, {"local_window_blocks": [2]}),
        (VariableSparsityConfig, {"local_window_blocks": [2], "attention": "unidirectional"}),
        (VariableSparsityConfig, {"local_window_blocks": [2], "horizontal_global_attention": True}),
        (BSLongformerSparsityConfig, {}),
    ],
)
def test_negative_global_indices_count_from_the_last_block(cls, kw):
    """As Python's indexing (and upstream's) reads them; they were dropped."""
    blocks = 6

    def layout(starts, ends=None):
        return cls(
            num_heads=1, block=1, global_block_indices=starts, global_block_end_indices=ends, **kw
        ).make_layout(blocks)

    assert torch.equal(layout([-1]), layout([blocks - 1]))
    assert torch.equal(layout([0, -2]), layout([0, blocks - 2]))
    assert torch.equal(layout([-3], [-1]), layout([blocks - 3], [blocks - 1]))
    with pytest.raises(ValueError, match="global block index -7 is before the first"):
        layout([-7])
