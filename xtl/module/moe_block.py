"""The MoE feed-forward block and the decoder layer that carries it."""

from __future__ import annotations

import torch
from torch import nn

from xtl.module.decoder_layer import DecoderLayer
from xtl.module.dispatcher import LocalDispatcher, MoEDispatcher
from xtl.module.experts import GroupedExperts
from xtl.module.kv_cache import NO_LAYER_KV_CACHE, LayerKVCache
from xtl.module.router import Router, RouterOutput
from xtl.ops.attention import AttentionMaskSpec


class MoEBlock(nn.Module):
    """Router -> dispatch -> grouped experts -> combine, plus optional always-on shared experts.

    Args:
        gate: The router (saved as ``gate``).
        experts: The routed experts.
        shared_experts: A dense MLP applied to every token and added to the routed output (DeepSeek).
        dispatcher: Token dispatcher (default: :class:`LocalDispatcher`, all experts on this rank).
    """

    def __init__(
        self,
        gate: Router,
        experts: GroupedExperts,
        shared_experts: nn.Module | None = None,
        dispatcher: MoEDispatcher | None = None,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.dispatcher = dispatcher or LocalDispatcher(gate.num_experts)
        self.recording = False
        self.recorded: torch.Tensor | None = None
        self.forced_ids: torch.Tensor | None = None

    def record_routing(self, on: bool) -> None:
        """Keep the experts each forward chooses in :attr:`recorded` (``(N, k)``, the last forward's) while on."""
        self.recording = on
        if on:
            self.recorded = None

    def replay_routing(self, topk_ids: torch.Tensor | None) -> None:
        """Route the next forwards' tokens to these experts (``(N, k)``; ``None``: the router chooses again). The
        combine weights are the router's current ones for the forced experts, so the router still trains."""
        self.forced_ids = topk_ids

    @property
    def num_experts(self) -> int:
        """Routed experts of the layer (on all ranks together)."""
        return self.gate.num_experts

    def update_router_bias(self, tokens_per_expert: torch.Tensor, lr: float | torch.Tensor) -> None:
        """The router's aux-loss-free bias step from this layer's ``(E,)`` loads (no-op without a correction bias)."""
        self.gate.update_bias(tokens_per_expert, lr)

    def use_dispatcher(self, dispatcher: MoEDispatcher) -> None:
        """Move tokens to the experts with ``dispatcher`` (expert parallelism installs an all-to-all one)."""
        self.dispatcher = dispatcher

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        """Apply the block to ``(B, T, C)``; returns the output and the routing of the ``B*T`` tokens."""
        shape = hidden_states.shape
        routing = self.gate(hidden_states.view(-1, shape[-1]))
        if self.forced_ids is not None:
            routing = self.gate.reroute(routing, self.forced_ids.to(routing.topk_ids.device))
        if self.recording:
            self.recorded = routing.topk_ids.detach().clone()
        dispatched = self.dispatcher.dispatch(
            hidden_states.view(-1, shape[-1]), routing.topk_ids, routing.topk_weights
        )
        expert_out = self.experts(dispatched.hidden_states, dispatched.tokens_per_expert)
        out = self.dispatcher.combine(expert_out, dispatched).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out, routing


class MoEDecoderLayer(DecoderLayer):
    """A pre-norm decoder layer whose feed-forward is a :class:`MoEBlock`; also returns the routing."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
        kv_cache: LayerKVCache = NO_LAYER_KV_CACHE,
    ) -> tuple[torch.Tensor, RouterOutput]:
        """Run the layer on ``(B, T, C)``; returns the new hidden states and the router output."""
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, mask, kv_cache)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states, routing = self.mlp(hidden_states)
        return residual + hidden_states, routing
