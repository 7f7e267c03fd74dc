"""DeepSpeedTransformerConfig: upstream's fields, names and defaults, checked when a layer is
built (upstream fails later, inside its kernels, or not at all)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TransformerConfig:
    def __init__(
        self,
        batch_size: int,
        hidden_size: int,
        intermediate_size: int,
        heads: int,
        attn_dropout_ratio: float,
        hidden_dropout_ratio: float,
        num_hidden_layers: int,
        initializer_range: float,
    ) -> None:
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range


class DeepSpeedTransformerConfig(TransformerConfig):
    """The layer's shape and options, as upstream names them.

    batch_size is the largest batch a forward may take (-1: any); intermediate_size defaults to
    4 * hidden_size; fp16 makes the layer take float16 (otherwise float32 or bfloat16, the
    dtype the parameters are in); pre_layer_norm chooses pre-LN (LayerNorm before attention and
    before the feed-forward) or post-LN (BERT's original); seed (-1: drawn at random) seeds the
    dropout masks. The memory options trade recompute for activation memory
    ([Note: transformer memory options]): normalize_invertible, gelu_checkpoint,
    attn_dropout_checkpoint. stochastic_mode (upstream: faster, non-deterministic kernels) is
    accepted; these kernels are deterministic either way.
    """

    def __init__(
        self,
        batch_size: int = -1,
        hidden_size: int = -1,
        intermediate_size: int = -1,
        heads: int = -1,
        attn_dropout_ratio: float = -1,
        hidden_dropout_ratio: float = -1,
        num_hidden_layers: int = -1,
        initializer_range: float = -1,
        layer_norm_eps: float = 1e-12,
        local_rank: int = -1,
        seed: int = -1,
        fp16: bool = False,
        pre_layer_norm: bool = True,
        normalize_invertible: bool = False,
        gelu_checkpoint: bool = False,
        adjust_init_range: bool = True,
        attn_dropout_checkpoint: bool = False,
        stochastic_mode: bool = False,
        return_tuple: bool = False,
        training: bool = True,
    ) -> None:
        super().__init__(
            batch_size,
            hidden_size,
            intermediate_size if intermediate_size > 0 else 4 * hidden_size,
            heads,
            attn_dropout_ratio,
            hidden_dropout_ratio,
            num_hidden_layers,
            initializer_range,
        )
        self.fp16 = fp16
        self.pre_layer_norm = pre_layer_norm
        self.local_rank = local_rank
        self.seed = seed
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.test_gemm = False
        self.layer_norm_eps = layer_norm_eps
        self.training = training
        self.is_grad_enabled = True
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> DeepSpeedTransformerConfig:
        config = cls()
        known = set(vars(config))
        unknown = sorted(set(json_object) - known)
        if unknown:
            raise ValueError(
                f"DeepSpeedTransformerConfig: unknown field(s) {unknown}; the fields are "
                f"{sorted(known - {'layer_id', 'test_gemm', 'is_grad_enabled'})}"
            )
        for key, value in json_object.items():
            setattr(config, key, value)
        if "intermediate_size" not in json_object or config.intermediate_size <= 0:
            config.intermediate_size = 4 * config.hidden_size
        return config

    @classmethod
    def from_json_file(cls, json_file: str | Path) -> DeepSpeedTransformerConfig:
        # upstream reads these files as UTF-16; accept that and UTF-8 alike
        raw = Path(json_file).read_bytes()
        text = raw.decode("utf-16") if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else raw.decode()
        return cls.from_dict(json.loads(text))

    def check(self) -> None:
        """Raises ValueError naming the field and the fix."""

        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"DeepSpeedTransformerConfig.{field}={getattr(self, field)!r}: {why}")

        for field in ("hidden_size", "heads", "intermediate_size"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) <= 0:
                raise bad(field, "must be a positive int (it has no usable default)")
        if self.hidden_size % self.heads:
            raise bad("hidden_size", f"must be divisible by heads={self.heads}")
        for field in ("attn_dropout_ratio", "hidden_dropout_ratio"):
            if not 0 <= getattr(self, field) < 1:
                raise bad(field, "must be in [0, 1) (set 0 for no dropout)")
        if not 0 < self.layer_norm_eps < 1:
            raise bad("layer_norm_eps", "must be in (0, 1)")
        if self.batch_size == 0 or self.batch_size < -1:
            raise bad("batch_size", "must be > 0 (the largest batch), or -1 for any")
        if self.initializer_range <= 0 and self.initializer_range != -1:
            raise bad("initializer_range", "must be > 0 (the std of the initial weights)")
