"""Projections that share one input, computed as one matmul, behind one selector.

A fused projection is one ``nn.Linear`` whose output rows are the concatenated rows of several projections of
the same input (q/k/v, or gate/up): ``(sum(sizes), C)``. :func:`get_fused_projection_fn` returns the op that
produces the parts:

- :func:`project_fused`: one linear, its output split along the last dimension (views, no copy): one matmul
  and, under autocast, one weight cast instead of one per projection.
- :func:`project_parts`: one linear per part on the rows of the weight (views), the very calls separate
  ``nn.Linear`` modules make, so outputs and gradients equal transformers' separate projections bitwise.

``XTL_HF_IMPL=1`` makes the selector return :func:`project_parts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from xtl.ops.selector import hf_impl_enabled

FusedProjectionFn = Callable[[torch.Tensor, nn.Module, Sequence[int]], tuple[torch.Tensor, ...]]


def get_fused_projection_fn() -> FusedProjectionFn:
    """Return the fused-projection op: :func:`project_parts` under ``XTL_HF_IMPL``, else :func:`project_fused`."""
    return project_parts if hf_impl_enabled() else project_fused


def project_fused(x: torch.Tensor, linear: nn.Module, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``linear(x)`` split into parts of ``sizes`` along the last dimension.

    Args:
        x: The input ``(..., C)``.
        linear: The fused projection (any module computing ``x -> (..., sum(sizes))``: ``nn.Linear``, fp8, ...).
        sizes: Output width of each part.
    """
    return tuple(linear(x).split(list(sizes), dim=-1))


def project_parts(x: torch.Tensor, linear: nn.Module, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """One ``F.linear`` per part on the rows of ``linear``'s weight and bias (a module that is not a plain
    ``nn.Linear``, e.g. an fp8 one, is called once and split)."""
    if type(linear) is not nn.Linear:
        return project_fused(x, linear, sizes)
    weights = linear.weight.split(list(sizes), dim=0)
    biases = linear.bias.split(list(sizes), dim=0) if linear.bias is not None else (None,) * len(sizes)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
