"""The value every model forward returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModelOutput:
    """Result of a model forward.

    Attributes:
        loss: Mean cross-entropy over supervised tokens (``None`` without labels).
        loss_sum: Sum of per-token cross-entropy (for global-token normalization across ranks/micro-batches).
        num_tokens: Number of supervised tokens (labels != -100) in this forward.
        logits: Vocabulary logits, if requested.
        hidden_states: Final hidden states (after the last norm), if requested.
        extras: Family extras (router losses, tokens per expert, ...).
    """

    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
