"""Upstream's engine methods for training loops that drive parts of a step by hand: scale()
for a manual loss.backward(), clip_fp32_gradients(), load_module_state_dict() and
all_gather_scalar(). A mixin of the engine, over what the engine composes."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from deepspeed_ext import comm

from .grad_clip import clip_factor


class EngineManual:
    # set by the engine
    module: torch.nn.Module
    strategy: Any
    optimizer: Any
    loss_scaler: Any
    metrics: Any
    _gas: int

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call .backward() on by hand, as engine.backward(loss) would: divided by
        the accumulation steps and multiplied by the fp16 loss scale. Then engine.step()."""
        if self.optimizer is None:
            raise RuntimeError("engine.scale() needs an optimizer: the engine was built without")
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            raise ValueError(
                "engine.scale(loss): loss must be a scalar tensor that requires grad; for "
                "other tensors call tensor.backward(grad) yourself"
            )
        self._states_here("scale")  # type: ignore[attr-defined]
        return self._scaled_loss(loss, True)

    def _scaled_loss(self, loss: torch.Tensor, scale_wrt_gas: bool) -> torch.Tensor:
        """What engine.backward and a manual backward after scale() backpropagate: the loss
        (recorded for the metrics) in fp32, divided by the accumulation steps, times the fp16
        loss scale."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            # before any state is touched: a caller that catches this goes on cleanly
            what = (
                f"a tensor of shape {tuple(loss.shape)}"
                if torch.is_tensor(loss)
                else type(loss).__name__
            )
            raise TypeError(
                f"the loss must be a scalar tensor, not {what}: reduce it (loss.mean()) or "
                "take the model output's loss (outputs.loss, outputs[0])"
            )
        self.metrics.add_loss(loss.detach())
        scaled = loss.float() / self._gas if scale_wrt_gas else loss.float()
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.loss_scale
        return scaled

    @torch.no_grad()
    def clip_fp32_gradients(self) -> float:
        """Clip the gradients to the config's gradient_clipping norm over every rank's part
        (the step clips the same way); returns the norm before clipping."""
        max_norm = float(self.gradient_clipping())  # type: ignore[attr-defined]
        # fp16 gradients carry the loss scale until the step: the norm is of unscaled ones
        scaler = self.loss_scaler
        inv = 1.0 / scaler.loss_scale if scaler is not None else 1.0
        norm = math.sqrt(float(self.strategy.grad_sq_sum())) * inv
        factor = clip_factor(1.0, norm, max_norm)
        if factor != 1.0:
            self.strategy.scale_grads_(factor)
        return norm

    def load_module_state_dict(
        self,
        checkpoint: dict[str, Any],
        strict: bool = True,
        custom_load_fn: Callable[..., Any] | None = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: list[Any] | None = None,
        allowed_missing_keys: list[str] | None = None,
    ) -> None:
        """Load checkpoint['module'] (whole weights) into the model, and the fp32 masters
        from it. Stage 3 gathers the parameters around the load (all of them: every rank
        must call it), whatever fetch_z3_params says, since a partitioned parameter cannot
        take a whole weight."""
        if "module" not in checkpoint:
            raise KeyError(
                "load_module_state_dict: checkpoint has no 'module' entry (keys: "
                f"{sorted(checkpoint)[:8]}); pass {{'module': state_dict}}"
            )
        state = checkpoint["module"]
        stage3 = self.strategy.stage == 3
        gather: Any
        if stage3:
            from deepspeed_ext.zero.stage3.gathered import GatheredParameters

            params = z3_params_to_fetch or list(self.module.parameters())
            gather = GatheredParameters(params, modifier_rank=0)
        else:
            gather = contextlib.nullcontext()
        with gather:
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
            else:
                result = self.module.load_state_dict(
                    state, strict=strict and not allowed_missing_keys
                )
                missing = set(result.missing_keys) - set(allowed_missing_keys or [])
                if strict and allowed_missing_keys and (missing or result.unexpected_keys):
                    raise RuntimeError(
                        f"load_module_state_dict: missing {sorted(missing)}, unexpected "
                        f"{sorted(result.unexpected_keys)}"
                    )
        if not stage3:  # stage 3's GatheredParameters updated its shards and masters
            self.strategy.sync_masters_from_model()

    def all_gather_scalar(self, value: torch.Tensor, dp_group: Any = None) -> list[torch.Tensor]:
        """value from every rank of dp_group (the data-parallel group when None)."""
        from deepspeed_ext.comm.layout import resolve

        group = dp_group if dp_group is not None else self.strategy.dp
        out = [value.new_zeros(value.size()) for _ in range(resolve(group)[1])]
        comm.all_gather(out, value, group=group)
        return out
