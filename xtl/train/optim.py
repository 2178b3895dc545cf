"""AdamW with parameter groups and warmup + decay learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

Schedule = Literal["cosine", "linear", "constant"]


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias_embed: bool = True) -> list[dict]:
    """Split trainable parameters into a decayed group and (optionally) an undecayed one.

    Norm weights, biases and embeddings get no weight decay when ``no_decay_norm_bias_embed`` is set.
    """
    no_decay_ids = set()
    if no_decay_norm_bias_embed:
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if (
                    isinstance(module, nn.Embedding)
                    or "norm" in type(module).__name__.lower()
                    or name.endswith("bias")
                ):
                    no_decay_ids.add(id(param))
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if id(param) in no_decay_ids else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_adamw(
    groups: list[dict], lr: float, betas: tuple[float, float], eps: float, device: torch.device
) -> torch.optim.AdamW:
    """AdamW, fused on CUDA, foreach elsewhere."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused, foreach=None if fused else True)


def lr_lambda(schedule: Schedule, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base learning rate at a step: linear warmup, then cosine/linear decay or constant."""
    if schedule not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown lr_schedule {schedule!r}; use cosine, linear or constant")

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor
