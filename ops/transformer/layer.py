"""DeepSpeedTransformerLayer: a BERT encoder layer over the fused kernels
([Note: transformer kernels]), with upstream's parameters, initial_weights/initial_biases order
and forward signature.

[Note: transformer memory options]
What a layer keeps for backward, per option (the rest is recomputed in backward):
- normalize_invertible: each LayerNorm keeps its output, not its input; x-hat is recomputed
  from the output, so the LayerNorm inputs (the residual stream) are not kept.
- gelu_checkpoint: the feed-forward keeps the pre-GeLU activations only; the GeLU output
  (intermediate_size wide) is recomputed for the second GEMM's weight gradient.
- attn_dropout_checkpoint: attention keeps the softmax output only; the dropped
  probabilities are recomputed from the replayed dropout mask ([Note: replayed dropout]).
Results are the same with each option on or off, up to rounding (invertible LayerNorm
recomputes x-hat from the output).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_ext.accelerator import get_accelerator

from .config import DeepSpeedTransformerConfig
from .functions import (
    BiasDropoutResidualFn,
    BiasGeluFn,
    BiasGeluLinearFn,
    DropoutFn,
    DropoutMatmulFn,
    LayerFn,
    LayerNormFn,
    SoftmaxFn,
)
from .kernels import TorchKernels, kernels_for

# upstream's parameters, in the order the layer op takes them ([Note: transformer layer op])
PARAM_NAMES = (
    "attn_qkvw",
    "attn_qkvb",
    "attn_ow",
    "attn_ob",
    "attn_nw",
    "attn_nb",
    "inter_w",
    "inter_b",
    "output_w",
    "output_b",
    "norm_w",
    "norm_b",
)


def _additive_mask(mask: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """An attention mask as fp32 [b, 1 or s, s]: floating masks are additive, as given (HF's
    extended [b, 1, 1, s] or [b, 1, s, s], or [b, s] / [b, s, s]); bool and integer masks
    (a tokenizer's 0/1 attention_mask) say which keys to attend, as BertSparseSelfAttention
    reads them: added as 0/1 they masked nothing."""
    if not mask.is_floating_point():
        if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(
                "DeepSpeedTransformerLayer: an integer attention_mask holds values other than "
                "0 and 1; integer masks say which keys to attend (1) or not (0): give an "
                "additive mask as a floating tensor (e.g. mask.float())"
            )
        keep = mask.bool() if mask.dtype != torch.bool else mask
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~keep, float("-inf"))
    m = mask.float()
    if m.dim() == 4 and m.shape[1] == 1:
        m = m[:, 0]
    elif m.dim() == 2:
        m = m[:, None]
    if m.dim() != 3 or m.shape[0] != b or m.shape[1] not in (1, s) or m.shape[2] != s:
        raise ValueError(
            f"DeepSpeedTransformerLayer: attention_mask has shape {tuple(mask.shape)}; expected "
            f"one of [{b}, {s}], [{b}, 1, 1, {s}], [{b}, {s}, {s}], [{b}, 1, {s}, {s}] for "
            f"hidden_states [{b}, {s}, hidden] (no per-head masks)"
        )
    return m.contiguous()


class DeepSpeedTransformerLayer(nn.Module):
    """One BERT encoder layer. forward(hidden_states [batch, seq, hidden], attention_mask)
    -> [batch, seq, hidden] (a 1-tuple with config.return_tuple)."""

    layer_id = 0  # counts the layers built, as upstream's static counter does
    attn_qkvw: nn.Parameter
    attn_qkvb: nn.Parameter
    attn_ow: nn.Parameter
    attn_ob: nn.Parameter
    attn_nw: nn.Parameter
    attn_nb: nn.Parameter
    inter_w: nn.Parameter
    inter_b: nn.Parameter
    output_w: nn.Parameter
    output_b: nn.Parameter
    norm_w: nn.Parameter
    norm_b: nn.Parameter

    def __init__(
        self,
        config: DeepSpeedTransformerConfig,
        initial_weights: list[torch.Tensor] | None = None,
        initial_biases: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        config.check()
        self.config = config
        config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        if config.local_rank >= 0 and get_accelerator().device_name() != "cpu":
            get_accelerator().set_device(config.local_rank)
        h, i = config.hidden_size, config.intermediate_size
        shapes = {
            "attn_qkvw": (3 * h, h),
            "attn_qkvb": (3 * h,),
            "attn_ow": (h, h),
            "attn_ob": (h,),
            "attn_nw": (h,),
            "attn_nb": (h,),
            "inter_w": (i, h),
            "inter_b": (i,),
            "output_w": (h, i),
            "output_b": (h,),
            "norm_w": (h,),
            "norm_b": (h,),
        }
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape)))
        if initial_weights is None and initial_biases is None:
            self.init_transformer_weights(config.adjust_init_range)
        else:
            self._load_initial(initial_weights, initial_biases)
        seed = config.seed if config.seed >= 0 else int(torch.randint(0, 2**62, ()).item())
        self._seed = seed + config.layer_id  # each layer its own masks
        self._offset = 0
        self._grad_hooks: list[Any] = []

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        c = self.config
        if c.initializer_range <= 0:
            raise ValueError(
                f"DeepSpeedTransformerConfig.initializer_range={c.initializer_range}: set the std "
                "of the initial weights (e.g. 0.02), or pass initial_weights"
            )
        out_std = c.initializer_range
        if adjust_init_range and c.num_hidden_layers > 0:
            # the residual stream sums 2 outputs per layer: scale them down (GPT-2's rule).
            # Upstream does this on local_rank 0 only, leaving ranks with different weights.
            out_std = c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)
        with torch.no_grad():
            self.attn_qkvw.normal_(0.0, c.initializer_range)
            self.attn_ow.normal_(0.0, out_std)
            self.inter_w.normal_(0.0, c.initializer_range)
            self.output_w.normal_(0.0, out_std)
            for b in (self.attn_qkvb, self.attn_ob, self.attn_nb, self.inter_b, self.output_b):
                b.zero_()
            for b in (self.norm_b,):
                b.zero_()
            self.attn_nw.fill_(1.0)
            self.norm_w.fill_(1.0)

    def _load_initial(
        self, weights: list[torch.Tensor] | None, biases: list[torch.Tensor] | None
    ) -> None:
        """Upstream's order: q, k, v, attention output, its LayerNorm (attn_n*), intermediate,
        output, the output LayerNorm (norm_*). Upstream leaves the q/k/v biases zero even when
        initial_biases has them; here they are used."""
        names = ("attn_ow", "attn_nw", "inter_w", "output_w", "norm_w")
        bias_names = ("attn_ob", "attn_nb", "inter_b", "output_b", "norm_b")
        with torch.no_grad():
            for given, qkv, rest, what in (
                (weights, "attn_qkvw", names, "initial_weights"),
                (biases, "attn_qkvb", bias_names, "initial_biases"),
            ):
                if given is None:
                    if what == "initial_biases":
                        for n in (qkv, *rest):
                            getattr(self, n).zero_()
                        continue
                    raise ValueError("initial_biases without initial_weights: pass both or neither")
                if len(given) != 8:
                    raise ValueError(
                        f"{what} has {len(given)} tensors; expected 8 (q, k, v, attention output, "
                        "attention LayerNorm, intermediate, output, output LayerNorm)"
                    )
                self._copy(qkv, torch.cat([t.detach() for t in given[:3]]), what + "[0:3]")
                for k, n in enumerate(rest, start=3):
                    self._copy(n, given[k].detach(), f"{what}[{k}]")

    def _copy(self, name: str, value: torch.Tensor, what: str) -> None:
        p = getattr(self, name)
        if value.shape != p.shape:
            raise ValueError(f"{what} has shape {tuple(value.shape)}; {name} is {tuple(p.shape)}")
        p.copy_(value)

    # -- forward -----------------------------------------------------------------------------

    def _check_input(self, x: torch.Tensor) -> None:
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(
                f"DeepSpeedTransformerLayer: hidden_states has shape {tuple(x.shape)}; expected "
                f"[batch, seq, {c.hidden_size}]"
            )
        if c.batch_size > 0 and x.shape[0] > c.batch_size:
            raise ValueError(
                f"DeepSpeedTransformerLayer: batch {x.shape[0]} exceeds the config's batch_size="
                f"{c.batch_size}; raise batch_size (or set -1)"
            )
        want = self.attn_qkvw.dtype
        if c.fp16 and x.dtype != torch.float16:
            raise ValueError(
                f"DeepSpeedTransformerLayer: config.fp16=True but hidden_states is {x.dtype}; "
                "pass float16 (and call .half() on the layer)"
            )
        if not c.fp16 and x.dtype == torch.float16:
            raise ValueError(
                "DeepSpeedTransformerLayer: hidden_states is float16 but config.fp16=False; "
                "set fp16=True"
            )
        if x.dtype != want:
            raise ValueError(
                f"DeepSpeedTransformerLayer: hidden_states is {x.dtype} but the parameters are "
                f"{want}; convert one to the other"
            )

    def _next_offsets(self, *numels: int) -> list[int]:
        out = []
        for n in numels:
            out.append(self._offset)
            self._offset += n
        return out

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        head_mask: Any = None,
        layer_head_mask: Any = None,
        encoder_hidden_states: Any = None,
        encoder_attention_mask: Any = None,
        past_key_value: Any = None,
        output_attentions: bool = False,
        grads: list[Any] | None = None,
    ) -> Any:
        unsupported = {
            "head_mask": head_mask,
            "layer_head_mask": layer_head_mask,
            "encoder_hidden_states": encoder_hidden_states,
            "encoder_attention_mask": encoder_attention_mask,
            "past_key_value": past_key_value,
        }
        given = [k for k, v in unsupported.items() if v is not None] + (
            ["output_attentions"] if output_attentions else []
        )
        if given:
            raise ValueError(
                f"DeepSpeedTransformerLayer is an encoder self-attention layer: {given} not "
                "supported (upstream ignores them silently)"
            )
        c = self.config
        c.is_grad_enabled = torch.is_grad_enabled()
        c.training = self.training
        x = hidden_states
        self._check_input(x)
        b, s, h = x.shape
        heads, d = c.heads, h // c.heads
        mask = None if attention_mask is None else _additive_mask(attention_mask, b, s)
        train = self.training
        p_attn = c.attn_dropout_ratio if train else 0.0
        p_hid = c.hidden_dropout_ratio if train else 0.0
        off_attn, off_res1, off_res2 = self._next_offsets(b * heads * s * s, b * s * h, b * s * h)
        seed, eps, inv = self._seed, c.layer_norm_eps, c.normalize_invertible
        self._collect_grads(grads)
        kernels = kernels_for(x)
        if kernels is not TorchKernels:  # the compiled op runs the whole layer
            opts: tuple[Any, ...] = (heads, p_attn, p_hid, eps, seed, off_attn, off_res1)
            opts += (off_res2, c.pre_layer_norm, inv, c.gelu_checkpoint, c.attn_dropout_checkpoint)
            params = [getattr(self, n) for n in PARAM_NAMES]
            if torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in params)
            ):
                out = LayerFn.apply(x, mask, opts, *params)
            else:
                out, _ = kernels._lib().layer_fwd(x, mask, params, *opts, False)
            return (out,) if c.return_tuple else out

        attn_in = (
            LayerNormFn.apply(x, self.norm_w, self.norm_b, eps, inv) if c.pre_layer_norm else x
        )
        qkv = F.linear(attn_in, self.attn_qkvw, self.attn_qkvb)
        q, k, v = qkv.view(b, s, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-1, -2)
        probs = SoftmaxFn.apply(scores, mask, 1.0 / math.sqrt(d))
        if c.attn_dropout_checkpoint:
            ctx = DropoutMatmulFn.apply(probs, v, p_attn, seed, off_attn)
        else:
            ctx = DropoutFn.apply(probs, p_attn, seed, off_attn) @ v
        ctx = ctx.transpose(1, 2).reshape(b, s, h)
        add_res = BiasDropoutResidualFn.apply(
            F.linear(ctx, self.attn_ow), self.attn_ob, x, p_hid, seed, off_res1
        )
        ff_in = LayerNormFn.apply(add_res, self.attn_nw, self.attn_nb, eps, inv)
        inter = F.linear(ff_in, self.inter_w)
        if c.gelu_checkpoint:
            ff_out = BiasGeluLinearFn.apply(inter, self.inter_b, self.output_w)
        else:
            ff_out = F.linear(BiasGeluFn.apply(inter, self.inter_b), self.output_w)
        residual = add_res if c.pre_layer_norm else ff_in
        out = BiasDropoutResidualFn.apply(ff_out, self.output_b, residual, p_hid, seed, off_res2)
        if not c.pre_layer_norm:
            out = LayerNormFn.apply(out, self.norm_w, self.norm_b, eps, inv)
        return (out,) if c.return_tuple else out

    def _collect_grads(self, grads: list[Any] | None) -> None:
        """Upstream's test hook: with `grads` given, each parameter's gradient is appended to it
        as [tensor, name] when computed (q/k/v weights and biases split apart). The hooks of an
        earlier forward are removed first (upstream's pile up, one set per forward)."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        if grads is None or not self.attn_qkvw.requires_grad:
            return
        h = self.config.hidden_size
        hook = self._grad_hooks.append
        for i, tag in enumerate("QKV"):
            hook(
                self.attn_qkvw.register_hook(
                    lambda g, i=i, tag=tag: grads.append([g[i * h : (i + 1) * h], f"{tag}_W"])
                )
            )
            hook(
                self.attn_qkvb.register_hook(
                    lambda g, i=i, tag=tag: grads.append([g[i * h : (i + 1) * h], f"{tag}_B"])
                )
            )
        names = {
            "attn_ow": "O_W",
            "attn_ob": "O_B",
            "attn_nw": "N2_W",
            "attn_nb": "N2_B",
            "inter_w": "int_W",
            "inter_b": "int_B",
            "output_w": "out_W",
            "output_b": "out_B",
            "norm_w": "norm_W",
            "norm_b": "norm_B",
        }
        for attr, tag in names.items():
            hook(getattr(self, attr).register_hook(lambda g, tag=tag: grads.append([g, tag])))
