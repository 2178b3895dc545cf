"""Router gate logits behind one selector.

- ``fp32``: :func:`router_logits_fp32`, the gate computed in fp32 whatever the model dtype (the default: routing
  decisions do not flip with bf16 rounding).
- ``native``: :func:`router_logits_native`, the gate in the dtype of the hidden states, transformers' op for the
  routers that compute in the model dtype (Qwen3-MoE, GPT-OSS).

``XTL_HF_IMPL=1`` makes :func:`get_router_logits_fn` return ``native``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from xtl.ops.selector import hf_impl_enabled

RouterLogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def get_router_logits_fn() -> RouterLogitsFn:
    """Return the gate op ``fn(hidden_states, weight, bias) -> logits`` of a router.

    For a router whose transformers counterpart computes in the model dtype: :func:`router_logits_native` under
    ``XTL_HF_IMPL``, else :func:`router_logits_fp32`.
    """
    return router_logits_native if hf_impl_enabled() else router_logits_fp32


def router_logits_fp32(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(N, E)`` gate logits of ``(N, C)`` hidden states and an ``(E, C)`` weight, computed in fp32."""
    return F.linear(hidden_states.float(), weight.float(), None if bias is None else bias.float())


def router_logits_native(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(N, E)`` gate logits in the dtype of the hidden states (transformers' op for Qwen3-MoE and GPT-OSS)."""
    return F.linear(hidden_states, weight, bias)
