"""Modes and tolerances of a parity check: :data:`PARITY_MODES`, the :data:`TOLERANCES` presets and
:func:`resolve_tolerance`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

PARITY_MODES = ("hf_impl", "fast")


@dataclass(frozen=True)
class ParityTolerance:
    """Bounds of one check; a row passes when its tensors are equal or its error is within its bound.

    Attributes:
        hidden: Relative L2 error of the hidden states after the embedding, each decoder layer and the final norm.
        logits: Relative L2 error of the logits.
        loss: Absolute difference of the loss.
        grad: Relative L2 error of each checked gradient.
    """

    hidden: float
    logits: float
    loss: float
    grad: float

    def bound(self, kind: str) -> float:
        """The bound of a row kind (``hidden``, ``logits``, ``loss`` or ``grad``)."""
        return getattr(self, kind)


# Set from measurements on tiny random models of every family (docs/models.md, "Runtime parity check"): bf16 and
# fp8 gradient bounds are wide because a routing flip near a top-k tie moves MoE router and expert gradients by
# 10-60%; a bound below 1 still catches a dropped gradient (error 1) or a sign error (error 2).
TOLERANCES: dict[str, ParityTolerance] = {
    "bitwise": ParityTolerance(hidden=0.0, logits=0.0, loss=0.0, grad=0.0),
    # FSDP with a 16-bit param_dtype: the forward is transformers' to the bit, but each document's gradient is
    # reduced in reduce_dtype (fp32) and summed there, where transformers' 16-bit model sums them in 16 bits
    # (measured: 2-3e-3 relative, one bf16 rounding)
    "bitwise_forward": ParityTolerance(hidden=0.0, logits=0.0, loss=0.0, grad=1e-2),
    "fp32": ParityTolerance(hidden=1e-5, logits=1e-5, loss=1e-5, grad=1e-4),
    "bf16": ParityTolerance(hidden=5e-2, logits=5e-2, loss=5e-3, grad=0.3),
    "fp8": ParityTolerance(hidden=0.25, logits=0.25, loss=0.1, grad=0.75),
}


def resolve_tolerance(
    name: str, mode: str, dtype: torch.dtype, overrides: Mapping[str, float] | None = None
) -> tuple[str, ParityTolerance]:
    """The tolerance preset to check with, and its bounds with ``overrides`` applied.

    Args:
        name: ``auto`` or a key of :data:`TOLERANCES`. ``auto`` is ``bitwise`` in ``hf_impl`` mode, else ``bf16``
            for a 16-bit compute dtype and ``fp32`` otherwise.
        mode: ``hf_impl`` or ``fast``.
        dtype: The compute dtype of the comparison.
        overrides: Bounds replacing the preset's (keys ``hidden``, ``logits``, ``loss``, ``grad``).

    Raises:
        ValueError: Unknown preset, mode or override key, or a negative bound.
    """
    if mode not in PARITY_MODES:
        raise ValueError(f"mode must be one of {PARITY_MODES}, got {mode!r}")
    if name == "auto":
        name = "bitwise" if mode == "hf_impl" else ("bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32")
    if name not in TOLERANCES:
        raise ValueError(f"tolerance must be 'auto' or one of {sorted(TOLERANCES)}, got {name!r}")
    bounds = asdict(TOLERANCES[name])
    for key, value in (overrides or {}).items():
        if key not in bounds:
            raise ValueError(f"tolerances: unknown key {key!r}; use {sorted(bounds)}")
        if not float(value) >= 0:
            raise ValueError(f"tolerances.{key} must be >= 0, got {value!r}")
        bounds[key] = float(value)
    return (name if not overrides else f"{name}+overrides"), ParityTolerance(**bounds)
