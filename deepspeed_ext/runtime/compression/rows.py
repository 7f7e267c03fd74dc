"""The Huffman op as comm's row coder: each rank's row of top-k payloads coded with a
codebook of its own ([Note: Huffman stream]). The op runs on the CPU; rows made on a GPU
cross to the host for it (comm does that move). A row the code would not shrink (a small
one, whose 136-byte codebook outweighs the saving) travels as it is: the first byte says
which."""

from __future__ import annotations

import torch

from deepspeed_ext.ops import huffman

_STORED, _CODED = 0, 1


class HuffmanRows:
    def encode(self, row: torch.Tensor) -> torch.Tensor:
        coded = huffman.encode(row)
        if coded.numel() < row.numel():
            return torch.cat([torch.tensor([_CODED], dtype=torch.uint8), coded])
        return torch.cat([torch.tensor([_STORED], dtype=torch.uint8), row])

    def decode(self, stream: torch.Tensor) -> torch.Tensor:
        if stream.numel() == 0 or int(stream[0]) not in (_STORED, _CODED):
            raise RuntimeError("a Huffman row starts with neither the stored nor the coded mark")
        body = stream[1:]
        return huffman.decode(body) if int(stream[0]) == _CODED else body
