"""The optimizer step of Megatron-core's optimizer (``get_megatron_optimizer``'s ``ChainedOptimizer``, on CUDA), taken
as its ``step()`` takes it (fp32 main gradients, their norm, the clip, the update: the same calls in the same
order, so a finite step is the same step), except that the update is skipped when the step's
loss or gradient norm is not finite (``PolicyBackend.finish_train_step``'s contract): Megatron's own check
(``found_inf``) is a loss scaler's, for fp16 only, and a bf16 step would apply a NaN gradient to every weight.

Megatron-core is imported inside the function, so ``asyncrl`` imports without it."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["megatron_optimizer_step"]


@torch.no_grad()  # as Megatron's own step
def megatron_optimizer_step(opt: Any, finite_loss: bool) -> tuple[float, bool]:
    """One step of ``opt`` (a Megatron optimizer, chained or not): (the gradient norm before the clip, whether the
    weights were updated). Every rank computes the same norm (a collective), so every rank decides alike."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if opt.prepare_grads():  # inf/nan found (a loss scaler's check): Megatron skips such a step itself
        return math.nan, False
    grad_norm = float(opt.get_grad_norm())
    if not (finite_loss and math.isfinite(grad_norm)):
        return grad_norm, False
    for part in getattr(opt, "chained_optimizers", None) or [opt]:  # as ChainedOptimizer.step clips
        if getattr(part, "is_stub_optimizer", False):
            continue
        params = part.get_parameters()
        if part.config.clip_grad > 0.0 and params:
            decoupled = getattr(part.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
            clip_grad_by_total_norm_fp32(params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=decoupled)
    return grad_norm, bool(opt.step_with_ready_grads())
