"""The packbits op as comm's sign codec ([Note: compressed all-reduce])."""

from __future__ import annotations

import torch

from deepspeed_ext.ops.packbits import sign_compress, sign_decompress


class PackBitsCodec:
    def compress(self, x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sign_compress(x, error)

    def decompress(
        self,
        bits: torch.Tensor,
        scale: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        accumulate: bool,
    ) -> torch.Tensor:
        return sign_decompress(bits, scale, numel, out=out, accumulate=accumulate)
