"""The fused kernels' tiles of a layout ([Note: fused tile masks]): blocks of 16 and 32 made
into 64-token tiles, each with a bit per 16 x 16 sub-block, against a construction that asks
the layout about every token pair's block directly."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig
from deepspeed_ext.ops.sparse_attention.lut import lut_for, tiles_for


def expected_tiles(layout: torch.Tensor, block: int) -> dict[tuple[int, int, int], int]:
    """(head, tile row, tile column) -> mask, from the layout entry of each sub-block's first
    token pair (a 16 x 16 sub-block lies inside one layout block of 16 or more)."""
    heads, nb, _ = layout.shape
    n = -(-nb * block // 64)  # a partial last tile counts
    out = {}
    for h in range(heads):
        for r in range(n):
            for c in range(n):
                bits = 0
                for qi in range(4):
                    for ki in range(4):
                        i, j = 64 * r + 16 * qi, 64 * c + 16 * ki
                        inside = max(i, j) < nb * block
                        if inside and layout[h, i // block, j // block]:
                            bits |= 1 << (4 * qi + ki)
                if bits:
                    out[(h, r, c)] = bits
    return out


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize(
    "config",
    [
        lambda b: BigBirdSparsityConfig(3, b, different_layout_per_head=True, num_random_blocks=2),
        lambda b: FixedSparsityConfig(3, b, num_local_blocks=3, attention="unidirectional"),
    ],
    ids=["bigbird", "fixed_causal"],
)
def test_fine_layouts_become_coarse_tiles_with_sub_block_masks(block, config):
    layout = config(block).make_layout(384)
    tiles = tiles_for(layout, block)
    lut = tiles.lut
    assert lut.block == 64 and lut.nb == 6 and tiles.mask is not None
    got = {
        (int(h), int(r), int(c)): int(m)
        for h, r, c, m in zip(lut.heads, lut.rows, lut.cols, tiles.mask)
    }
    assert got == expected_tiles(layout, block)
    assert tiles.mask.dtype == torch.int32 and (tiles.mask != 0).all()
    assert tiles_for(layout, block) is tiles  # cached


@pytest.mark.parametrize("block", [64, 128])
def test_coarse_blocks_are_their_own_tiles(block):
    layout = BigBirdSparsityConfig(2, block, num_random_blocks=1).make_layout(4 * block)
    tiles = tiles_for(layout, block)
    assert tiles.mask is None and tiles.lut is lut_for(layout, block)


@pytest.mark.parametrize("block,tokens", [(16, 80), (16, 208), (32, 96)])
def test_a_length_off_the_tile_grid_is_padded_with_empty_blocks(block, tokens):
    """The last tile is partial: its padded sub-blocks have no bit set, so padded queries
    attend to nothing and padded keys are attended by none."""
    layout = BigBirdSparsityConfig(2, block, num_random_blocks=1).make_layout(tokens)
    tiles = tiles_for(layout, block)
    assert tiles.seq == -(-tokens // 64) * 64 and tiles.mask is not None
    lut = tiles.lut
    got = {
        (int(h), int(r), int(c)): int(m)
        for h, r, c, m in zip(lut.heads, lut.rows, lut.cols, tiles.mask)
    }
    assert got == expected_tiles(layout, block)
