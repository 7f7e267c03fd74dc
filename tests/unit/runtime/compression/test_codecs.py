"""The gradient codecs ([Note: gradient codecs]) on one process: payloads of the stated size,
error feedback exact (what decodes plus the new error is the input plus the old error), each
codec's own rule (the largest |values| for top-k, two magnitude levels for 2-bit), and the
Huffman rows shrinking top-k pairs."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.runtime.compression import HuffmanRows, SignCodec, TopKCodec, TwoBitCodec

CODECS = [SignCodec(), TwoBitCodec(), TopKCodec(0.05), TopKCodec(1.0)]
IDS = ["1bit", "2bit", "topk-5%", "topk-all"]


def roundtrip(codec, x, error):
    out = torch.empty(codec.wire_bytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, error, out)
    dec = torch.empty(x.numel())
    codec.decode(out, x.numel(), dec, 1.0, False)
    return out, dec


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4099])
def test_error_feedback_is_exact(codec, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    error = torch.randn(n, generator=g) * 0.1
    y = x + error
    out, dec = roundtrip(codec, x, error)
    assert out.numel() % 4 == 0
    torch.testing.assert_close(dec + error, y, rtol=0, atol=1e-5)
    # decode's weight and accumulate: out + w * decoded
    acc = torch.ones(n)
    codec.decode(out, n, acc, 0.5, True)
    torch.testing.assert_close(acc, 1 + 0.5 * dec)


def test_wire_sizes() -> None:
    c = 4096
    assert SignCodec().wire_bytes(c) == 4 + c // 8  # 1/32 of fp32, and a scale
    assert TwoBitCodec().wire_bytes(c) == 8 + c // 4  # 1/16, and two scales
    assert TopKCodec(0.01).wire_bytes(c) == 8 * 41  # ceil(1% of c) pairs of 4 + 4 bytes
    assert TopKCodec(1e-9).wire_bytes(c) == 8  # at least one pair


def test_topk_sends_the_largest_values_and_keeps_the_rest() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    error = torch.zeros(1000)
    _, dec = roundtrip(TopKCodec(0.02), x, error)
    sent = dec.nonzero().reshape(-1)
    assert set(sent.tolist()) == set(x.abs().topk(20).indices.tolist())
    assert torch.equal(dec[sent], x[sent])  # values travel exactly
    assert torch.equal(error[sent], torch.zeros(20)) and torch.equal(error + dec, x)


def test_two_bits_lose_less_than_one() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(2))
    _, one = roundtrip(SignCodec(), x, torch.zeros_like(x))
    _, two = roundtrip(TwoBitCodec(), x, torch.zeros_like(x))
    assert len(torch.unique(two.abs())) == 2  # two magnitude levels
    high = x.abs() >= x.abs().mean()
    assert torch.equal(two.abs() == two.abs().max(), high)
    assert (two - x).norm() < 0.8 * (one - x).norm()


def test_huffman_rows_shrink_topk_pairs_and_give_them_back() -> None:
    codec, rows = TopKCodec(0.01), HuffmanRows()
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(3))
    payload, _ = roundtrip(codec, x, torch.zeros_like(x))
    stream = rows.encode(payload)
    assert torch.equal(rows.decode(stream), payload)
    # the int32 gaps are small numbers: their high bytes are nearly all zero
    assert stream.numel() < 0.8 * payload.numel(), (stream.numel(), payload.numel())


def test_a_row_too_small_to_shrink_travels_as_it_is() -> None:
    rows = HuffmanRows()
    row = torch.randint(
        0, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)
    )
    stream = rows.encode(row)
    assert stream.numel() == 65 and torch.equal(rows.decode(stream), row)
    with pytest.raises(RuntimeError, match="neither the stored nor the coded mark"):
        rows.decode(torch.tensor([7, 1, 2], dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 8, 33, 1003, 65_543])
def test_two_bit_kernels_match_the_torch_reference(dtype: torch.dtype, n: int) -> None:
    """[Note: two-bit packing]: the packbits op's planes and levels against the same math in
    torch ops (the path other devices take)."""
    codec = TwoBitCodec()
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 2).to(dtype)
    e_op, e_ref = [torch.randn(n, generator=g) * 0.1] * 2
    e_op, e_ref = e_op.clone(), e_ref.clone()
    op_out = torch.empty(codec.wire_bytes(n), dtype=torch.uint8)
    ref_out = op_out.clone()
    codec.encode(x, e_op, op_out)
    codec.encode_torch(x, e_ref, ref_out)
    assert torch.equal(op_out[8:], ref_out[8:])  # both bit planes
    torch.testing.assert_close(op_out[:8].view(torch.float32), ref_out[:8].view(torch.float32))
    torch.testing.assert_close(e_op, e_ref, rtol=0, atol=1e-5)
    got, want = torch.ones(n), torch.ones(n)
    codec.decode(op_out, n, got, 0.25, True)
    codec.decode_torch(ref_out, n, want, 0.25, True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_two_bit_op_checks_its_inputs() -> None:
    from deepspeed_ext.ops.packbits import op

    ops = op(torch.device("cpu"))
    x, bits = torch.zeros(16), torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="levels lo=-1"):
        ops.pack2(x, None, 0.0, -1.0, 1.0, bits, bits.clone())
    with pytest.raises(RuntimeError, match="bits has 1 bytes"):
        ops.pack2(x, None, 0.0, 0.0, 1.0, bits[:1], bits.clone())
    with pytest.raises(RuntimeError, match="out has dtype"):
        ops.unpack2(bits, bits, 0.0, 1.0, torch.zeros(16, dtype=torch.float64), False)
