"""Runs an optimizer under test beside a reference on identical gradients.

[Note: kernel tolerance]
"Within twice PyTorch's own error": both our kernel and torch's own fp32 implementation
are compared with the same math done in float64 (with the param rounded to its storage
dtype after each step, as any 16-bit-param optimizer must); ours may err by at most twice
what torch errs, plus a tiny floor so an exact-zero torch error cannot fail us.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SHAPES = [(1,), (7,), (33,), (1000,), (257, 129), (16, 16), (4099,)]

MakeOpt = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def make_params(dtype: torch.dtype, seed: int = 0, shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def make_grads(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def clone_params(params: list[torch.Tensor], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().to(dtype).clone()) for p in params]


def run(
    make_opt: MakeOpt,
    params: list[torch.nn.Parameter],
    grads: list[list[torch.Tensor]],
    grad_dtype: torch.dtype | None = None,
    round_to: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Steps make_opt(params) through grads; returns the final params in float64.

    round_to: after each step, round the params to this dtype and back (what storing them in
    that dtype does), for references that compute in a wider type than the params hold.
    """
    opt = make_opt(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            gd = grad_dtype or p.dtype
            if gd != p.dtype and hasattr(p, "grad_dtype"):
                p.grad_dtype = None  # torch >= 2.10 requires opting in to mixed-dtype grads
            p.grad = g.to(gd)
        opt.step()
        if round_to is not None:
            with torch.no_grad():
                for p in params:
                    p.copy_(p.to(round_to).to(p.dtype))
    return [p.detach().double() for p in params]


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def assert_within_twice_torch(
    ours: list[torch.Tensor],
    torch_own: list[torch.Tensor],
    ref64: list[torch.Tensor],
    storage: torch.dtype = torch.float32,
    floor: float = 1e-7,
) -> tuple[float, float]:
    """|ours - ref| <= 2 * (torch's max error) per element, for fp32 params.

    16-bit params: a different but equally exact fp32 evaluation may round a value that sits
    on a rounding boundary to its neighbour, and later steps carry that on; so at most 0.1%
    of elements may exceed the bound, and none by more than 4 ulps of the storage dtype.
    A broken kernel moves nearly every element.
    """
    e_ours, e_torch = max_err(ours, ref64), max_err(torch_own, ref64)
    total = sum(o.numel() for o in ours)
    off = 0
    for o, r in zip(ours, ref64):
        if not o.numel():  # an empty param has nothing to compare
            continue
        excess = (o - r).abs() - (2 * e_torch + floor)
        off += int((excess > 0).sum())
        if storage == torch.float32:
            assert float(excess.max()) <= 0, (
                f"our error {e_ours:.3e} vs float64 exceeds twice torch's own ({e_torch:.3e})"
            )
        else:
            ulps = 4 * torch.finfo(storage).eps * r.abs().clamp_min(torch.finfo(storage).tiny)
            assert bool((excess <= ulps).all()), (
                f"an element is off by more than 4 {storage} ulps (max error {e_ours:.3e}, "
                f"torch's own {e_torch:.3e})"
            )
    assert off <= max(1, total // 1000), f"{off} of {total} elements exceed twice torch's error"
    return e_ours, e_torch


def parity(
    ours: MakeOpt,
    reference: MakeOpt,
    dtype: torch.dtype,
    steps: int = 25,
    grad_dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    """Ours on `dtype` params vs reference in fp32 (torch's own) and float64 (truth)."""
    # Start all three from params and grads that the tested dtypes hold exactly.
    base = make_params(dtype)
    gd = grad_dtype or dtype
    grads = [[g.to(gd).float() for g in gs] for gs in make_grads(base, steps)]
    rounding = None if dtype == torch.float32 else dtype
    got = run(ours, clone_params(base, dtype), grads, grad_dtype=gd)
    own = run(reference, clone_params(base, torch.float32), grads, round_to=rounding)
    ref = run(reference, clone_params(base, torch.float64), grads, round_to=rounding)
    return assert_within_twice_torch(got, own, ref, storage=dtype)


def state_dict_roundtrip(make_opt: MakeOpt, dtype: torch.dtype, steps: int = 10) -> None:
    """Save after k steps, load into a fresh optimizer, continue: must equal uninterrupted."""
    base = make_params(dtype)
    grads = make_grads(base, 2 * steps)
    a = clone_params(base, dtype)
    opt_a = make_opt(a)
    saved: dict[str, Any] = {}
    for i, step_grads in enumerate(grads):
        if i == steps:
            import copy

            saved = copy.deepcopy(opt_a.state_dict())
            snapshot = [p.detach().clone() for p in a]
        for p, g in zip(a, step_grads):
            p.grad = g.to(dtype)
        opt_a.step()
    b = [torch.nn.Parameter(s.clone()) for s in snapshot]
    opt_b = make_opt(b)
    opt_b.load_state_dict(saved)
    for step_grads in grads[steps:]:
        for p, g in zip(b, step_grads):
            p.grad = g.to(dtype)
        opt_b.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y), "resumed run differs from the uninterrupted run"
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert sa[k].dtype == sb[k].dtype, f"state {k} dtype changed on load"
