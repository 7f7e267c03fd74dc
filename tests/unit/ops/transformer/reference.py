"""A plain-torch BERT encoder layer (F.layer_norm, F.gelu, torch.softmax), the reference the
fused layer is checked against. Reads the weights of a DeepSpeedTransformerLayer; dropout, when
asked for, uses the keep masks the fused layer's next forward will draw."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepspeed_ext.ops.transformer import DeepSpeedTransformerLayer, dropout_keep_mask

NAMES = (
    "attn_qkvw attn_qkvb attn_ow attn_ob attn_nw attn_nb inter_w inter_b output_w output_b "
    "norm_w norm_b"
).split()


def params_of(layer: DeepSpeedTransformerLayer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: getattr(layer, n).detach().to(dtype).requires_grad_() for n in NAMES}


def next_masks(layer: DeepSpeedTransformerLayer, b: int, s: int) -> list[torch.Tensor]:
    """The keep masks of the layer's next training forward: attention probabilities, then
    the two residual dropouts (the order the layer draws its offsets in)."""
    c = layer.config
    h, heads = c.hidden_size, c.heads
    sizes = [(b, heads, s, s, c.attn_dropout_ratio), (b, s, h, c.hidden_dropout_ratio)]
    sizes.append(sizes[1])
    out, offset = [], layer._offset
    for *shape, p in sizes:
        n = math.prod(shape)
        out.append(dropout_keep_mask(n, p, layer._seed, offset).view(shape))
        offset += n
    return out


def bert_layer(
    p: dict[str, torch.Tensor],
    x: torch.Tensor,
    mask: torch.Tensor | None,
    heads: int,
    pre_ln: bool,
    eps: float,
    drop: tuple[list[torch.Tensor], float, float] | None = None,
) -> torch.Tensor:
    b, s, h = x.shape
    d = h // heads

    def ln(t, w, bias):
        return F.layer_norm(t, (h,), w, bias, eps)

    def dropout(t, i):
        if drop is None:
            return t
        masks, p_attn, p_hid = drop
        q = p_attn if i == 0 else p_hid
        return t * masks[i].to(t.device) / (1 - q)

    a_in = ln(x, p["norm_w"], p["norm_b"]) if pre_ln else x
    qkv = F.linear(a_in, p["attn_qkvw"], p["attn_qkvb"]).view(b, s, 3, heads, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    probs = dropout(torch.softmax(scores, -1), 0)
    ctx = (probs @ v).transpose(1, 2).reshape(b, s, h)
    add_res = x + dropout(F.linear(ctx, p["attn_ow"], p["attn_ob"]), 1)
    ff_in = ln(add_res, p["attn_nw"], p["attn_nb"])
    inter = F.gelu(F.linear(ff_in, p["inter_w"], p["inter_b"]), approximate="tanh")
    out = (add_res if pre_ln else ff_in) + dropout(F.linear(inter, p["output_w"], p["output_b"]), 2)
    return out if pre_ln else ln(out, p["norm_w"], p["norm_b"])
