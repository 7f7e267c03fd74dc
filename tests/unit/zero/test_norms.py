"""The gradient sum of squares: on the device, no host read, against torch's own norm."""

from __future__ import annotations

import math

import torch

from deepspeed_ext.zero.norms import sum_of_squares

CPU = torch.device("cpu")


def test_matches_torch_over_mixed_dtypes():
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(1000, generator=g),
        torch.randn(37, 5, generator=g).to(torch.bfloat16),
        torch.randn(129, generator=g).to(torch.float16),
        torch.empty(0),
    ]
    out = sum_of_squares(ts, CPU)
    assert out.dim() == 0 and out.dtype == torch.float64 and out.device == CPU
    ref = sum(float(t.double().square().sum()) for t in ts)
    assert math.isclose(float(out), ref, rel_tol=1e-6)


def test_no_tensors_is_zero():
    assert float(sum_of_squares([], CPU)) == 0.0


def test_past_fp32_range_and_non_finite():
    big = torch.full((3,), 1e19)  # 3e38 each: two overflow an fp32 sum, not the float64 one
    assert math.isclose(float(sum_of_squares([big, big], CPU)), 6e38, rel_tol=1e-5)
    assert math.isinf(float(sum_of_squares([big, torch.tensor([math.inf])], CPU)))
    assert math.isnan(float(sum_of_squares([big, torch.tensor([math.nan])], CPU)))
