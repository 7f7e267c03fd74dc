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


def check_layout(layout: torch.Tensor, block: int) -> torch.Tensor:
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(
            f"layout has shape {tuple(layout.shape)}; expected [heads, blocks, blocks] "
            "(SparsityConfig.make_layout)"
        )
    if block not in (16, 32, 64, 128):
        raise ValueError(f"block={block}: the kernels take blocks of 16, 32, 64 or 128")
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
