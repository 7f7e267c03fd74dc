"""A layout's look-up table for the block-sparse kernels ([Note: block-sparse kernels] in
csrc/sparse_attention), built once per layout and cached."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Lut:
    packed: torch.Tensor  # the op's int32 table (csrc/bindings/sparse_attention.cpp)
    heads: torch.Tensor  # [nnz] per block: head, block row, block column (int64)
    rows: torch.Tensor
    cols: torch.Tensor
    num_heads: int
    nb: int
    block: int
    _copies: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False)

    @property
    def nnz(self) -> int:
        return int(self.heads.numel())

    def on(self, device: torch.device) -> torch.Tensor:
        """The packed table on `device`, copied there once (the CUDA op reads it there)."""
        if device not in self._copies:
            self._copies[device] = self.packed.to(device)
        return self._copies[device]


_CACHE: dict[tuple[bytes, tuple[int, ...], int], Lut] = {}


def check_block(block: int) -> None:
    if block not in (16, 32, 64, 128):
        raise ValueError(
            f"block={block}: the kernels take blocks of 16, 32, 64 or 128 (the sparsity "
            "config's block)"
        )


def check_layout(layout: torch.Tensor, block: int) -> torch.Tensor:
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(
            f"layout has shape {tuple(layout.shape)}; expected [heads, blocks, blocks] "
            "(SparsityConfig.make_layout)"
        )
    check_block(block)
    layout = layout.detach().to("cpu", torch.int64)
    if not ((layout == 0) | (layout == 1)).all():
        raise ValueError("layout entries must be 0 or 1")
    empty = (layout.sum(-1) == 0).nonzero()
    if empty.numel():
        h, r = empty[0].tolist()
        raise ValueError(
            f"layout row {r} of head {h} has no block: its queries would attend to nothing "
            f"({empty.shape[0]} such rows); every block row needs at least one block"
        )
    return layout


def lut_for(layout: torch.Tensor, block: int) -> Lut:
    layout = check_layout(layout, block)
    key = (layout.numpy().tobytes(), tuple(layout.shape), block)
    if key not in _CACHE:
        _CACHE[key] = _build(layout, block)
    return _CACHE[key]


@dataclass(frozen=True)
class Tiles:
    """A layout as the fused kernels' 64 x 64 tiles ([Note: fused tile masks] in
    csrc/sparse_attention/sparse_flash.cu): blocks of 64 and 128 as they are; finer layouts
    made coarse, a tile present when any of its blocks is, with `mask[z]` (int32, one per block
    of `lut`) setting bit 4 qi + ki when the tile's 16 x 16 sub-block (qi, ki) is attended.
    A finer layout whose length is not a whole number of tiles is padded to one: `seq` is
    the tiles' length (lut.nb * lut.block), which the operands are padded to."""

    lut: Lut
    mask: torch.Tensor | None
    _copies: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False)

    @property
    def seq(self) -> int:
        return self.lut.nb * self.lut.block

    def mask_on(self, device: torch.device) -> torch.Tensor | None:
        if self.mask is None:
            return None
        if device not in self._copies:
            self._copies[device] = self.mask.to(device)
        return self._copies[device]


_TILES: dict[tuple[bytes, tuple[int, ...], int], Tiles] = {}
FUSED_TILE = 64


def tiles_for(layout: torch.Tensor, block: int) -> Tiles:
    layout = check_layout(layout, block)
    if block >= FUSED_TILE:
        return Tiles(lut_for(layout, block), None)
    key = (layout.numpy().tobytes(), tuple(layout.shape), block)
    if key not in _TILES:
        # a partial last tile: empty blocks make it whole (no bit of theirs is set, so padded
        # queries attend to nothing and padded keys are attended by none; fused.attention pads
        # the operands to match)
        extra = (-layout.shape[1] * block) % FUSED_TILE // block
        layout = torch.nn.functional.pad(layout, (0, extra, 0, extra))
        heads, nb, _ = layout.shape
        r, n = block // 16, nb * block // FUSED_TILE
        fine = layout.repeat_interleave(r, 1).repeat_interleave(r, 2)  # 16-token blocks
        sub = fine.reshape(heads, n, 4, n, 4).permute(0, 1, 3, 2, 4).reshape(heads, n, n, 16)
        bits = (sub << torch.arange(16)).sum(-1)  # bit 4 qi + ki: sub-block (qi, ki)
        present = bits != 0
        # boolean indexing walks (head, row, column) as nonzero() does: the table's block order
        _TILES[key] = Tiles(lut_for(present.long(), FUSED_TILE), bits[present].to(torch.int32))
    return _TILES[key]


def _build(layout: torch.Tensor, block: int) -> Lut:
    heads, nb, _ = layout.shape
    nz = layout.nonzero()  # (h, r, c) in layout order: the sparse tensor's block order
    h, r, c = nz[:, 0], nz[:, 1], nz[:, 2]
    nnz = nz.shape[0]
    z = torch.arange(nnz)
    row_key, col_key = h * nb + r, h * nb + c
    row_idx = z  # layout order is already by (head, row, column)
    col_idx = z[torch.argsort(col_key * nb + r, stable=True)]
    row_ptr = torch.zeros(heads * nb + 1, dtype=torch.int64)
    col_ptr = torch.zeros(heads * nb + 1, dtype=torch.int64)
    row_ptr[1:] = torch.bincount(row_key, minlength=heads * nb).cumsum(0)
    col_ptr[1:] = torch.bincount(col_key, minlength=heads * nb).cumsum(0)
    packed = torch.cat(
        [
            torch.tensor([nnz, heads, nb, block]),
            nz.reshape(-1),
            row_ptr,
            row_idx,
            col_ptr,
            col_idx,
        ]
    ).to(torch.int32)
    return Lut(packed, h, r, c, heads, nb, block)
