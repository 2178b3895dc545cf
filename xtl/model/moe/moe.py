"""The MoE decoder-only body shared by Qwen3-MoE, DeepSeek-V3 and GPT-OSS."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from xtl.batch import SequenceContext
from xtl.model.dense.dense import Dense
from xtl.module.decoder_layer import DecoderLayer
from xtl.module.kv_cache import NO_KV_CACHE, KVCache
from xtl.module.moe_block import MoEBlock, MoEDecoderLayer
from xtl.ops.attention import AttentionMaskSpec
from xtl.ops.moe_loss import router_statistics

if TYPE_CHECKING:
    from xtl.model.moe.config import MoEConfig

_EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up|down)")


class MoE(Dense):
    """Dense's embedding / norm / head and call styles, with :class:`MoEBlock` feed-forwards.

    ``forward`` returns, besides the loss and logits of :class:`Dense`, these ``extras`` (L = number of MoE
    layers, in the order of :attr:`moe_layer_indices`; E = routed experts; counted tokens = all tokens except
    padding, i.e. ``attention_mask == 0`` positions or the trailing ``seq_ctx.num_padding`` tokens):

    - ``router_prob_sum`` ``(L, E)`` fp32, differentiable: per-expert router probability summed over counted tokens.
    - ``router_z_sum`` ``(L,)`` fp32, differentiable: ``logsumexp(router_logits)**2`` summed over counted tokens.
    - ``tokens_per_expert`` ``(L, E)`` int64: (token, slot) assignments per expert among counted tokens.
    - ``router_num_tokens`` ``()`` int64: the number of counted tokens.

    :func:`xtl.ops.moe_loss.balance_loss` and :func:`xtl.ops.moe_loss.z_loss` turn them into losses normalized by
    a (global) token count. The cross-entropy ``loss`` does not include them.

    The default checkpoint mapping stores each expert separately (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
    """

    config: MoEConfig

    @property
    def moe_layer_indices(self) -> list[int]:
        """Decoder-layer indices of the MoE layers (row order of the ``(L, ...)`` extras)."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, MoEDecoderLayer)]

    def build_layer(self, layer_idx: int) -> DecoderLayer:
        """Decoder layer ``layer_idx``: attention plus an MoE block or a dense MLP."""
        cfg = self.config
        attn = self.build_attention(layer_idx)
        if cfg.is_moe_layer(layer_idx):
            shared = None
            if cfg.shared_experts_intermediate_size:
                shared = self.build_mlp(cfg.shared_experts_intermediate_size, bias=False)
            block = MoEBlock(cfg.build_router(), cfg.build_experts(), shared)
            return MoEDecoderLayer(attn, block, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_class)
        return DecoderLayer(attn, self.build_mlp(), cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_class)

    def run_layers(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
        attention_mask: torch.Tensor | None,
        seq_ctx: SequenceContext | None,
        kv_cache: KVCache = NO_KV_CACHE,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the layers, collecting router statistics of the MoE layers (see the class docstring)."""
        token_mask = router_token_mask(hidden, attention_mask, seq_ctx)
        stats = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, MoEDecoderLayer):
                hidden, routing = layer(hidden, position_embeddings, mask, kv_cache.layer(i))
                stats.append(router_statistics(routing.logits, routing.probs, routing.topk_ids, token_mask))
            else:
                hidden = layer(hidden, position_embeddings, mask, kv_cache.layer(i))
        return hidden, self._extras(stats, hidden, token_mask)

    # ---- HF key mapping: one HF tensor per expert and projection ------------------------------------------

    def to_hf_key_list(self, key: str) -> list[str]:
        """Fused expert parameters map to one HF key per expert (gate keys first, then up keys)."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is None:
            return super().to_hf_key_list(key)
        prefix = f"model.layers.{match[1]}.mlp.experts"
        experts = range(self.config.num_routed_experts)
        if match[2] == "down":
            return [f"{prefix}.{e}.down_proj.weight" for e in experts]
        return [f"{prefix}.{e}.gate_proj.weight" for e in experts] + [f"{prefix}.{e}.up_proj.weight" for e in experts]

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Stack per-expert HF tensors into the grouped parameter."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is None:
            return super().hf_to_param(key, tensors)
        if match[2] == "down":
            return torch.stack(tensors)
        half = len(tensors) // 2
        return torch.cat((torch.stack(tensors[:half]), torch.stack(tensors[half:])), dim=1)

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Split the grouped parameter into per-expert HF tensors (inverse of :meth:`hf_to_param`)."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is None:
            return super().param_to_hf(key, tensor)
        if match[2] == "down":
            return [t.clone() for t in tensor.unbind(0)]
        gate, up = tensor.chunk(2, dim=1)
        return [t.clone() for t in (*gate.unbind(0), *up.unbind(0))]

    def hf_matrix_rows(self, key: str, rows: int) -> tuple[int, ...]:
        """An expert's ``gate_up`` matrix is two HF matrices, its gate rows then its up rows."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is not None and match[2] == "gate_up":
            return (rows // 2, rows // 2)
        return super().hf_matrix_rows(key, rows)

    @torch.compiler.disable  # eager under a compiled forward: a pack with padding and one without would compile twice
    def _extras(self, stats: list, hidden: torch.Tensor, token_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        num_tokens = hidden.shape[0] * hidden.shape[1] if token_mask is None else token_mask.sum()
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.int64, device=hidden.device)
        if not stats:
            experts = self.config.num_routed_experts
            zeros = torch.zeros(0, experts, device=hidden.device)
            return {
                "router_prob_sum": zeros,
                "router_z_sum": zeros.new_zeros(0),
                "tokens_per_expert": zeros.long(),
                "router_num_tokens": num_tokens,
            }
        prob_sums, z_sums, counts = zip(*stats)
        return {
            "router_prob_sum": torch.stack(prob_sums),
            "router_z_sum": torch.stack(z_sums),
            "tokens_per_expert": torch.stack(counts),
            "router_num_tokens": num_tokens,
        }


@torch.compiler.disable  # eager under a compiled forward: the padding count would be guarded on, a recompile
def router_token_mask(
    hidden: torch.Tensor, attention_mask: torch.Tensor | None, seq_ctx: SequenceContext | None
) -> torch.Tensor | None:
    """``(B*T,)`` bool of the tokens that count for router statistics, or ``None`` when all count."""
    if attention_mask is not None:
        return attention_mask.reshape(-1).bool().to(hidden.device)
    if seq_ctx is not None and seq_ctx.num_padding:
        mask = torch.ones(hidden.shape[0] * hidden.shape[1], dtype=torch.bool, device=hidden.device)
        mask[-seq_ctx.num_padding :] = False
        return mask
    return None
