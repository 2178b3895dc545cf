"""Causal-LM cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xtl.utils import hf_impl_enabled

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Turn HF-style labels (``labels[t]`` = token t) into targets (``out[t]`` = token t+1), padding the end."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def causal_lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean loss, summed loss, supervised token count)`` of shifted ``targets``.

    Under ``XTL_HF_IMPL`` the mean is transformers' exact op (fp32 ``cross_entropy`` with mean reduction) and the
    sum is derived from it; otherwise the sum is computed directly and the mean derived (0 when no token counts).
    """
    if hf_impl_enabled():
        loss = cross_entropy_mean(logits, targets, ignore_index)
        num_tokens = (targets != ignore_index).sum()
        return loss, loss * num_tokens, num_tokens
    loss_sum, num_tokens = cross_entropy_sum(logits, targets, ignore_index)
    return loss_sum / num_tokens.clamp(min=1), loss_sum, num_tokens


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies in fp32 and the number of supervised tokens.

    Args:
        logits: ``(..., V)`` logits in any dtype (upcast to fp32 as transformers does).
        targets: ``(...)`` target ids, ``ignore_index`` where no loss.

    Returns:
        ``(loss_sum, num_tokens)``.
    """
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).to(flat_logits.device)
    loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")
    return loss_sum, (flat_targets != ignore_index).sum()


def cross_entropy_mean(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean token cross-entropy in fp32, the exact op of transformers' ``ForCausalLMLoss``."""
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat_logits, targets.reshape(-1).to(flat_logits.device), ignore_index=ignore_index)
