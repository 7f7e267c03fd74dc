"""FLOPs and MACs of the functional ops the profiler counts, from their arguments.

[Note: FLOP conventions]
Upstream's conventions, so our counts match its published profiles (LeNet-5: 866,076,672
FLOPs, 426,516,480 MACs at batch 1024):
- a product of an (m x k) and a (k x n) matrix is m*n*k MACs and 2*m*n*k FLOPs; a linear
  layer's bias is not counted, a convolution's bias is (one add per output element);
- elementwise activations, softmax, pooling, add and mul: one FLOP per element of the output
  (pooling: of the input), no MACs; embedding lookups and dropout: none;
- normalization: 5 FLOPs per element with an affine transform (mean, variance, normalize,
  scale, shift), 4 without;
- attention (scaled_dot_product_attention): the two products, QK^T and PV, in full, also when
  causal (as the math is written, not as a fused kernel may skip it).
Each returns (flops, macs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Count = tuple[int, int]
_NONE: Count = (0, 0)


def _numel(x: Any) -> int:
    return int(x.numel()) if isinstance(x, torch.Tensor) else 1


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * n


def linear(input: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> Count:
    macs = input.numel() * weight.shape[0]
    return 2 * macs, macs


def elementwise(input: Any, *args: Any, **kwargs: Any) -> Count:
    return _numel(input), 0


def binary(input: Any, other: Any, *args: Any, **kwargs: Any) -> Count:
    if isinstance(input, torch.Tensor) and isinstance(other, torch.Tensor):
        return math.prod(torch.broadcast_shapes(input.shape, other.shape)), 0
    return max(_numel(input), _numel(other)), 0


def none(*args: Any, **kwargs: Any) -> Count:
    return _NONE


def pool(input: torch.Tensor, *args: Any, **kwargs: Any) -> Count:
    return input.numel(), 0


def _conv_out(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def conv(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Count:
    spatial = weight.dim() - 2
    kernel = tuple(weight.shape[2:])
    in_sizes = tuple(input.shape[-spatial:])
    batch = input.shape[0] if input.dim() == spatial + 2 else 1
    strides, dils = _tuple(stride, spatial), _tuple(dilation, spatial)
    if isinstance(padding, str):  # "same" keeps the size, "valid" pads nothing
        outs = (
            in_sizes
            if padding == "same"
            else tuple(
                _conv_out(s, k, st, 0, d) for s, k, st, d in zip(in_sizes, kernel, strides, dils)
            )
        )
    else:
        pads = _tuple(padding, spatial)
        outs = tuple(
            _conv_out(s, k, st, p, d)
            for s, k, st, p, d in zip(in_sizes, kernel, strides, pads, dils)
        )
    out_channels = weight.shape[0]
    out_elems = batch * out_channels * math.prod(outs)
    macs = out_elems * weight.shape[1] * math.prod(kernel)  # weight.shape[1] = in / groups
    return 2 * macs + (out_elems if bias is not None else 0), macs


def conv_transpose(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    groups: int = 1,
    dilation: Any = 1,
) -> Count:
    # weight: [in, out / groups, *kernel]; each input element scatters into out/groups * kernel
    spatial = weight.dim() - 2
    kernel = tuple(weight.shape[2:])
    in_sizes = tuple(input.shape[-spatial:])
    batch = input.shape[0] if input.dim() == spatial + 2 else 1
    strides, pads = _tuple(stride, spatial), _tuple(padding, spatial)
    out_pads, dils = _tuple(output_padding, spatial), _tuple(dilation, spatial)
    outs = tuple(
        (s - 1) * st - 2 * p + d * (k - 1) + op + 1
        for s, st, p, d, k, op in zip(in_sizes, strides, pads, dils, kernel, out_pads)
    )
    macs = batch * weight.shape[0] * math.prod(in_sizes) * weight.shape[1] * math.prod(kernel)
    out_elems = batch * weight.shape[1] * groups * math.prod(outs)
    return 2 * macs + (out_elems if bias is not None else 0), macs


def _normalization(weight_at: int) -> Callable[..., Count]:
    """A norm's count, affine when its functional got a `weight` (positional argument
    `weight_at`, or by name)."""

    def count(input: torch.Tensor, *args: Any, **kwargs: Any) -> Count:
        weight = args[weight_at - 1] if len(args) >= weight_at else kwargs.get("weight")
        return input.numel() * (5 if weight is not None else 4), 0

    return count


# F.layer_norm(input, normalized_shape, weight, ...), F.group_norm(input, num_groups, weight,
# ...), F.batch_norm / F.instance_norm(input, running_mean, running_var, weight, ...)
layer_norm = group_norm = _normalization(2)
batch_norm = instance_norm = _normalization(3)


def rms_norm(
    input: torch.Tensor, normalized_shape: Any = None, weight: Any = None, *a: Any, **k: Any
) -> Count:
    # square, mean, rsqrt-scale: 3 per element, and the weight: 1
    return input.numel() * (4 if weight is not None else 3), 0


def upsample(
    input: torch.Tensor, size: Any = None, scale_factor: Any = None, *a: Any, **k: Any
) -> Count:
    spatial = input.dim() - 2
    if size is not None:
        out = math.prod(_tuple(size, spatial))
    else:
        out = math.prod(
            int(s * f) for s, f in zip(input.shape[2:], _tuple_f(scale_factor, spatial))
        )
    return input.shape[0] * input.shape[1] * out, 0


def _tuple_f(v: Any, n: int) -> tuple[float, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (float(v),) * n


def matmul(input: torch.Tensor, other: torch.Tensor, *args: Any, **kwargs: Any) -> Count:
    k = input.shape[-1]
    if input.dim() == 1 and other.dim() == 1:
        macs = k
    else:
        a = input.shape if input.dim() > 1 else (1, k)
        b = other.shape if other.dim() > 1 else (k, 1)
        batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
        macs = math.prod(batch) * a[-2] * b[-1] * k
    return 2 * macs, macs


def addmm(input: Any, mat1: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> Count:
    flops, macs = matmul(mat1, mat2)
    return flops + mat1.shape[-2] * mat2.shape[-1] * (math.prod(mat1.shape[:-2]) or 1), macs


def einsum(equation: str, *operands: Any) -> Count:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    lhs = equation.replace(" ", "").split("->")[0]
    terms = lhs.split(",")
    if "..." in lhs or len(terms) != len(operands):
        return _NONE  # ellipsis forms: not counted rather than guessed
    sizes: dict[str, int] = {}
    for term, op in zip(terms, operands):
        for ch, n in zip(term, op.shape):
            sizes[ch] = int(n)
    if len(terms) == 1:
        return _NONE
    # contracted pairwise, left to right: each pair costs the product of its letters
    macs, acc = 0, set(terms[0])
    if "->" in equation:
        out = set(equation.replace(" ", "").split("->")[1])
    else:  # implicit output: the letters that appear once (einsum's rule)
        out = {c for c in sizes if lhs.count(c) == 1}
    for i, term in enumerate(terms[1:], start=1):
        letters = acc | set(term)
        macs += math.prod(sizes[c] for c in letters)
        later = set("".join(terms[i + 1 :])) | out
        acc = {c for c in letters if c in later}
    return 2 * macs, macs


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **k: Any
) -> Count:
    lq, e = query.shape[-2], query.shape[-1]
    lk, ev = key.shape[-2], value.shape[-1]
    batch = math.prod(query.shape[:-2])
    macs = batch * lq * lk * (e + ev)
    return 2 * macs, macs


def rnn(*args: Any, **kwargs: Any) -> Count:
    """torch._VF.lstm/gru/rnn_tanh/rnn_relu, as nn.LSTM/GRU/RNN call them: every weight
    matrix (input-hidden, hidden-hidden, projection; each layer and direction) multiplies
    one vector per time step and sequence. Called (input, hx, weights, ...) or, packed,
    (data, batch_sizes, hx, weights, ...)."""
    data = args[0]
    packed = torch.is_tensor(args[1]) and args[1].dim() == 1 and not args[1].is_floating_point()
    weights = args[3] if packed else args[2]
    rows = data.shape[0] if packed else data.numel() // data.shape[-1]
    macs = rows * sum(w.numel() for w in weights if w.dim() == 2)
    adds = rows * sum(w.numel() for w in weights if w.dim() == 1)  # the biases
    return 2 * macs + adds, macs
