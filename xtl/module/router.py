"""MoE routers: which experts each token goes to, and with which combine weights.

Every router maps hidden states ``(N, C)`` to a :class:`RouterOutput`. Routing math runs in fp32; a router whose
transformers counterpart computes in the model dtype takes its gate op from :func:`xtl.ops.get_router_logits_fn`,
so the HF-parity selectors make it compute in the model dtype as well.

- :class:`SoftmaxTopKRouter`: softmax over all experts, top-k, optional renormalization (Qwen3-MoE).
- :class:`NoAuxTopKRouter`: sigmoid scores, aux-loss-free correction bias, group-limited top-k, scaling
  (DeepSeek-V3). The bias is updated after each optimizer step with :meth:`NoAuxTopKRouter.update_bias`.
- :class:`TopKSoftmaxRouter`: linear with bias, top-k of the logits, softmax over the selected k (GPT-OSS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xtl.module.traits import KeepsFp32
from xtl.ops.moe_routing import get_router_logits_fn, router_logits_fp32


@dataclass
class RouterOutput:
    """Result of one router call over N tokens and E experts.

    Attributes:
        logits: ``(N, E)`` raw router logits (fp32; the model dtype where transformers computes them so and the
            HF-parity selectors are on).
        probs: ``(N, E)`` fp32 per-expert probabilities (rows sum to 1), used by the load-balancing loss.
        topk_ids: ``(N, k)`` int64 selected experts (distinct per token).
        topk_weights: ``(N, k)`` combine weights of the selected experts.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class Router(nn.Module):
    """Base router: a ``(E, C)`` linear gate with an optional bias.

    Args:
        hidden_size: Model width C.
        num_experts: Routed experts E.
        top_k: Experts per token k.
        bias: Bias on the gate.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, bias: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, hidden_states: torch.Tensor) -> RouterOutput:  # pragma: no cover - overridden
        """Route ``(N, C)`` hidden states."""
        raise TypeError(f"{type(self).__name__} does not define forward")

    def fp32_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Gate logits computed in fp32."""
        return router_logits_fp32(hidden_states, self.weight, self.bias)

    def selected_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Gate logits through :func:`xtl.ops.get_router_logits_fn` (fp32, or the model dtype as transformers)."""
        return get_router_logits_fn()(hidden_states, self.weight, self.bias)

    def reroute(self, routing: RouterOutput, topk_ids: torch.Tensor) -> RouterOutput:
        """``routing`` sent to the experts ``topk_ids`` ``(N, k)`` instead (routing replay), with this router's
        combine weights for them (computed from ``routing.logits``, so they keep their gradient)."""
        raise TypeError(f"{type(self).__name__} does not define reroute")

    def update_bias(self, tokens_per_expert: torch.Tensor, lr: float | torch.Tensor) -> None:  # noqa: B027
        """Aux-loss-free balancing step (routers with a correction bias; default: nothing to update)."""


class SoftmaxTopKRouter(Router):
    """Softmax over all experts, top-k, optionally renormalized to sum to 1 (Qwen3-MoE, Mixtral).

    Args:
        hidden_size: Model width.
        num_experts: Routed experts.
        top_k: Experts per token.
        norm_topk_prob: Renormalize the selected probabilities.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True) -> None:
        super().__init__(hidden_size, num_experts, top_k)
        self.norm_topk_prob = norm_topk_prob

    def forward(self, hidden_states: torch.Tensor) -> RouterOutput:
        """Route ``(N, C)`` hidden states."""
        logits = self.selected_logits(hidden_states)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return self._output(logits, probs, ids, weights)

    def reroute(self, routing: RouterOutput, topk_ids: torch.Tensor) -> RouterOutput:
        """The forced experts with their (renormalized) probabilities."""
        return self._output(routing.logits, routing.probs, topk_ids, routing.probs.gather(1, topk_ids))

    def _output(
        self, logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> RouterOutput:
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)  # as transformers; a no-op for fp32 logits
        return RouterOutput(logits=logits, probs=probs, topk_ids=ids, topk_weights=weights)


class TopKSoftmaxRouter(Router):
    """Gate with bias; top-k of the logits, then softmax over the k selected (GPT-OSS).

    ``probs`` (for the balance loss) is the softmax over all experts.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden_size, num_experts, top_k, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> RouterOutput:
        """Route ``(N, C)`` hidden states."""
        logits = self.selected_logits(hidden_states)
        top_values, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(top_values, dim=1, dtype=top_values.dtype)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        return RouterOutput(logits=logits, probs=probs, topk_ids=ids, topk_weights=weights)

    def reroute(self, routing: RouterOutput, topk_ids: torch.Tensor) -> RouterOutput:
        """The forced experts, softmax over their logits."""
        values = routing.logits.gather(1, topk_ids)
        weights = F.softmax(values, dim=1, dtype=values.dtype)
        return RouterOutput(logits=routing.logits, probs=routing.probs, topk_ids=topk_ids, topk_weights=weights)


class NoAuxTopKRouter(KeepsFp32, Router):
    """DeepSeek-V3 routing: sigmoid scores, correction bias for the choice only, group-limited top-k.

    Experts are split into ``n_group`` groups; a group's score is the sum of its two best biased scores; only the
    ``topk_group`` best groups are eligible. Combine weights are the unbiased sigmoid scores of the chosen experts,
    optionally renormalized (``+1e-20``), times ``routed_scaling_factor``. ``probs`` (for a balance loss) are the
    sigmoid scores normalized per token.

    The gate ``weight`` and the ``e_score_correction_bias`` buffer stay fp32 whatever the module dtype, as in the
    released checkpoints (transformers keeps both in fp32 strictly); ``save_hf`` writes them in the dtype of the
    checkpoint they were loaded from (fp32 for a model initialized from scratch).

    Args:
        hidden_size: Model width.
        num_experts: Routed experts (divisible by ``n_group``).
        top_k: Experts per token.
        n_group: Expert groups.
        topk_group: Groups a token may use.
        norm_topk_prob: Renormalize the selected scores.
        routed_scaling_factor: Multiplier of the combine weights.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__(hidden_size, num_experts, top_k)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"bad grouping: {num_experts} experts, n_group={n_group}, topk_group={topk_group}")
        if topk_group * (num_experts // n_group) < top_k:
            raise ValueError(f"topk_group={topk_group} groups hold fewer than top_k={top_k} experts")
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    keep_fp32 = ("weight", "e_score_correction_bias")

    def forward(self, hidden_states: torch.Tensor) -> RouterOutput:
        """Route ``(N, C)`` hidden states."""
        logits = self.fp32_logits(hidden_states)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        return self._output(logits, scores, ids)

    def reroute(self, routing: RouterOutput, topk_ids: torch.Tensor) -> RouterOutput:
        """The forced experts with their (renormalized, scaled) sigmoid scores."""
        return self._output(routing.logits, routing.logits.sigmoid(), topk_ids)

    def _output(self, logits: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor) -> RouterOutput:
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return RouterOutput(logits=logits, probs=probs, topk_ids=ids, topk_weights=weights)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, lr: float | torch.Tensor) -> None:
        """Aux-loss-free balancing step: ``bias += lr * sign(mean_load - load)``.

        Overloaded experts become less likely to be chosen, underloaded ones more. Call after the optimizer step
        with the expert loads accumulated over the step (summed over micro-batches and data-parallel ranks, so
        every rank applies the same update).

        Args:
            tokens_per_expert: ``(E,)`` assignment counts of this layer.
            lr: Bias update speed (DeepSeek-V3 used 0.001).
        """
        load = tokens_per_expert.to(device=self.e_score_correction_bias.device, dtype=torch.float32)
        self.e_score_correction_bias.add_(lr * torch.sign(load.mean() - load))

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module signature
        # copies: _apply may swap the data of the very same Parameter object in place
        kept = {name: getattr(self, name).detach().clone() for name in self.keep_fp32}
        super()._apply(fn, recurse)
        for name, before in kept.items():  # a dtype cast of the module: keep these fp32 (no lossy round trip)
            new = getattr(self, name)
            if new.dtype != torch.float32:
                restored = before.to(device=new.device, dtype=torch.float32)
                if isinstance(new, nn.Parameter):
                    self._parameters[name] = nn.Parameter(restored, requires_grad=new.requires_grad)
                else:
                    self._buffers[name] = restored
        return self
