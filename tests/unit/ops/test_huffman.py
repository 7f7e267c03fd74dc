"""The Huffman coder ([Note: Huffman stream]): round trips on random, skewed and degenerate
bytes; the code lengths are optimal (Huffman's, checked against a Python build of the same
tree's cost) and capped at 15 bits; a corrupt stream is refused, naming why."""

from __future__ import annotations

import heapq
import math

import pytest
import torch

from deepspeed_ext.ops.huffman import decode, encode

HEADER = 8 + 128


def lengths_of(stream: torch.Tensor) -> list[int]:
    nibbles = stream[8:HEADER].tolist()
    return [v for b in nibbles for v in (b & 15, b >> 4)]


def optimal_bits(data: torch.Tensor) -> int:
    """The cost of an optimal (uncapped) prefix code of these bytes: Huffman's merge sum."""
    counts = [c for c in torch.bincount(data.long(), minlength=256).tolist() if c]
    if len(counts) == 1:
        return counts[0]
    heapq.heapify(counts)
    total = 0
    while len(counts) > 1:
        merged = heapq.heappop(counts) + heapq.heappop(counts)
        total += merged
        heapq.heappush(counts, merged)
    return total


def skewed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g).abs() * 4).clamp(max=255).to(torch.uint8)


@pytest.mark.parametrize(
    "data",
    [
        torch.randint(
            0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        ),
        skewed(65_536, 1),
        torch.full((1000,), 7, dtype=torch.uint8),  # one value: one bit each
        torch.tensor([3], dtype=torch.uint8),
        torch.zeros(0, dtype=torch.uint8),
        torch.arange(256, dtype=torch.uint8).repeat(3),
    ],
    ids=["random", "skewed", "one-value", "one-byte", "empty", "uniform"],
)
def test_round_trip_with_an_optimal_code(data: torch.Tensor) -> None:
    stream = encode(data)
    assert torch.equal(decode(stream), data)
    lens = lengths_of(stream)
    counts = torch.bincount(data.long(), minlength=256).tolist()
    assert all((length > 0) == (c > 0) for length, c in zip(lens, counts))
    coded = sum(length * c for length, c in zip(lens, counts))
    assert coded == optimal_bits(data) if data.numel() else coded == 0
    assert stream.numel() == HEADER + math.ceil(coded / 8)


def test_skewed_bytes_shrink_to_about_their_entropy() -> None:
    data = skewed(1 << 20, 2)
    p = torch.bincount(data.long(), minlength=256).double() / data.numel()
    entropy = float(-(p[p > 0] * p[p > 0].log2()).sum())  # bits per byte
    size = encode(data).numel()
    # Huffman's redundancy is below p_max + 0.086 bits a value (Gallager); here p_max ~ 0.2
    assert entropy * data.numel() / 8 <= size <= (entropy + 0.3) * data.numel() / 8 + HEADER


def test_codes_are_capped_at_fifteen_bits() -> None:
    # Fibonacci counts make a Huffman tree as deep as there are values (25 here)
    fib = [1, 1]
    while len(fib) < 25:
        fib.append(fib[-1] + fib[-2])
    data = torch.cat([torch.full((c,), v, dtype=torch.uint8) for v, c in enumerate(fib)])
    data = data[torch.randperm(data.numel(), generator=torch.Generator().manual_seed(3))]
    stream = encode(data)
    assert max(lengths_of(stream)) <= 15
    assert torch.equal(decode(stream), data)


def test_a_corrupt_stream_is_refused_by_name() -> None:
    data = skewed(4096, 4)
    stream = encode(data)
    with pytest.raises(RuntimeError, match="fewer than its 136-byte header"):
        decode(stream[:100].clone())
    with pytest.raises(RuntimeError, match="codes end after"):
        decode(stream[: HEADER + 600].clone())  # bits for 4800 values at most, not 4096 codes
    bad = stream.clone()
    bad[8:HEADER] = 0x11  # every value one bit long: not a prefix code
    with pytest.raises(RuntimeError, match="do not form a prefix code"):
        decode(bad)
    bad = stream.clone()
    bad[0:8] = 255  # a length the codes cannot hold
    with pytest.raises(RuntimeError, match="declares .* bytes, more than"):
        decode(bad)
    sparse = encode(torch.tensor([0, 1, 0, 1], dtype=torch.uint8))  # codes 0 and 1, 1 bit
    hole = encode(torch.tensor([0, 1, 2, 2], dtype=torch.uint8)).clone()
    hole[8] = 0x22  # values 0, 1 of length 2 only: the codes 10 and 11 are not in the book
    hole[9] = 0x00
    hole[HEADER] = 0b1100_0000
    with pytest.raises(RuntimeError, match="not in the book"):
        decode(hole)
    assert torch.equal(decode(sparse), torch.tensor([0, 1, 0, 1], dtype=torch.uint8))


def test_inputs_are_checked() -> None:
    with pytest.raises(RuntimeError, match="expected uint8"):
        encode(torch.zeros(4))
    with pytest.raises(RuntimeError, match="dimensions; expected 1"):
        encode(torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="not contiguous"):
        decode(torch.zeros(400, dtype=torch.uint8)[::2])
