"""The dense decoder-only body shared by Llama, Qwen2 and Qwen3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from xtl.batch import ModelOutput, SequenceContext
from xtl.model.base import TextModel
from xtl.module.attention import MultiHeadAttention
from xtl.module.decoder_layer import DecoderLayer
from xtl.module.kv_cache import NO_KV_CACHE, KVCache
from xtl.module.mlp import GatedMLP
from xtl.module.rope import RotaryEmbedding
from xtl.ops.attention import AttentionMaskSpec
from xtl.ops.cross_entropy import lm_head_loss, shift_labels
from xtl.ops.selector import hf_impl_enabled

if TYPE_CHECKING:
    from xtl.model.dense.config import DenseConfig


@dataclass
class ExtraHeadInputs:
    """What a forward hands to :meth:`Dense.extra_heads` besides the final hidden states.

    Attributes:
        embeds: The input embeddings ``(B, T, C)``.
        position_ids: Per-document positions ``(B, T)`` or ``(1, T)``.
        position_embeddings: The rotary ``(cos, sin)`` of the positions.
        mask: The attention mask of the call.
        targets: Shifted targets ``(B, T)`` (``None``: no loss wanted, or per-token losses only).
        rows: The positions the LM head and loss run on (``None``: every position).
        attention_mask: The HF-style padding mask, if any.
        seq_ctx: The packed batch, if any.
    """

    embeds: torch.Tensor
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    mask: AttentionMaskSpec
    targets: torch.Tensor | None
    rows: torch.Tensor | None
    attention_mask: torch.Tensor | None
    seq_ctx: SequenceContext | None


class Dense(TextModel):
    """Embedding, ``num_hidden_layers`` decoder layers, final norm (``config.norm_class``), LM head (tied or not).

    With ``config.num_labels`` the head is a sequence-classification head of that many outputs (transformers'
    ``score``, never tied): the "logits" of a position are its scores.

    Two call styles:

    - HF-style ``model(input_ids=..., labels=..., inputs_embeds=..., attention_mask=...)`` on a ``(B, T)`` batch,
      with unshifted labels as transformers takes them (used by parity tests and generation).
    - Packed ``model(seq_ctx=..., labels=...)`` on a ``(1, T)`` pack with labels already shifted
      (``labels[t]`` is the target of position ``t``), as the data pipeline produces them.

    Both take a ``kv_cache`` (:class:`xtl.module.kv_cache.KVCache`) for incremental decoding: a packed prefill
    (one prompt per cache row) or a left-padded ``(B, T)`` prefill, then ``(B, 1)`` steps with explicit
    ``position_ids`` (see :mod:`xtl.train.generation`).
    """

    def __init__(self, config: DenseConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([self.build_layer(i) for i in range(config.num_hidden_layers)])
        self.norm = config.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.num_labels or config.vocab_size, bias=False)
        self.tie_weights()
        self.rotary_emb = RotaryEmbedding(config.hf_config)

    def tie_weights(self) -> None:
        """Share the LM head with the input embedding when the config ties them (never a sequence-classification
        head, ``num_labels``)."""
        if self.config.tie_word_embeddings and not self.config.num_labels:
            self.lm_head.weight = self.embed_tokens.weight

    attention_class: type[MultiHeadAttention] = MultiHeadAttention

    def build_layer(self, layer_idx: int) -> DecoderLayer:
        """Build decoder layer ``layer_idx`` from the config's attention and MLP settings."""
        cfg = self.config
        return DecoderLayer(
            self.build_attention(layer_idx), self.build_mlp(), cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_class
        )

    def build_mlp(self, intermediate_size: int | None = None, bias: bool | None = None) -> GatedMLP:
        """A gated MLP of the config's activation (``intermediate_size`` / ``bias``: the config's by default),
        fused per ``fused_projections``."""
        cfg = self.config
        return GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size if intermediate_size is None else intermediate_size,
            cfg.hidden_act,
            bias=cfg.mlp_bias if bias is None else bias,
            fused_gate_up=cfg.fused_projections,
        )

    def build_attention(self, layer_idx: int) -> MultiHeadAttention:
        """The attention of layer ``layer_idx`` (``attention_class`` built from the config)."""
        cfg = self.config
        return self.attention_class(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.resolved_head_dim,
            bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm=cfg.qk_norm,
            rms_norm_eps=cfg.rms_norm_eps,
            attn_impl=cfg.attn_impl,
            sliding_window=cfg.layer_sliding_window(layer_idx),
            dropout=cfg.attention_dropout,
            fused_qkv=cfg.fused_projections,
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seq_ctx: SequenceContext | None = None,
        return_logits: bool = True,
        return_hidden_states: bool = False,
        kv_cache: KVCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> ModelOutput:
        """Run the model; see the class docstring for the two call styles.

        Args:
            input_ids: ``(B, T)`` token ids (HF-style).
            labels: HF-style: unshifted ``(B, T)``; packed: shifted ``(1, T)``. ``-100`` where no loss.
            inputs_embeds: ``(B, T, C)`` embeddings instead of ``input_ids``.
            attention_mask: ``(B, T)`` padding mask (1 = token, 0 = padding) of this call's tokens, HF-style only
                (with a ``kv_cache``, the cache keeps the masks of earlier calls).
            position_ids: ``(B, T)`` positions, HF-style only (default ``0..T-1``; pass them with a cache).
            seq_ctx: A packed batch; excludes the HF-style arguments.
            return_logits: Keep logits in the output.
            return_hidden_states: Keep the final (post-norm) hidden states in the output.
            kv_cache: Keys and values of earlier calls; this call's are appended (decoding).
            logits_to_keep: Head (logits, loss) only on the last ``n`` positions (0: all), or on the positions of
                a 1-D index tensor (e.g. each packed prompt's last token), as transformers' ``logits_to_keep``.
        """
        if seq_ctx is not None:
            if input_ids is not None or inputs_embeds is not None or attention_mask is not None:
                raise ValueError("pass either seq_ctx or input_ids/inputs_embeds/attention_mask, not both")
            input_ids, inputs_embeds, position_ids = seq_ctx.input_ids, seq_ctx.inputs_embeds, seq_ctx.position_ids
            mask = _packed_mask(seq_ctx)
            targets = labels
        else:
            mask = AttentionMaskSpec(padding_mask=attention_mask)
            targets = shift_labels(labels) if labels is not None else None
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("exactly one of input_ids and inputs_embeds must be given")
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(position_ids, embeds.dtype)
        cache = kv_cache or NO_KV_CACHE
        mask = cache.begin(mask, embeds.shape[0], embeds.shape[1], embeds.device)
        hidden, extras = self.run_layers(embeds, position_embeddings, mask, attention_mask, seq_ctx, cache)
        hidden = self.norm(hidden)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        rows = seq_ctx.loss_positions if seq_ctx is not None and targets is not None else None
        if (
            rows is not None
            and not return_logits
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
            and not hf_impl_enabled()
        ):
            keep = rows  # unsupervised rows add nothing to the loss: skip their head and loss work
        else:
            rows = None
        extras = self.extra_heads(
            hidden,
            ExtraHeadInputs(
                embeds=embeds,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                mask=mask,
                targets=targets,
                rows=rows,
                attention_mask=attention_mask,
                seq_ctx=seq_ctx,
            ),
            extras,
        )
        if isinstance(keep, torch.Tensor):  # index_select: its backward is one index_add (no sort, no big buffers)
            hidden, targets = hidden.index_select(1, keep), None if targets is None else targets.index_select(1, keep)
            keep = slice(None)
        targets = None if targets is None else targets[:, keep]
        logits, loss, loss_sum, num_tokens = self.head_loss(hidden[:, keep], targets, return_logits)
        return ModelOutput(
            loss=loss,
            loss_sum=loss_sum,
            num_tokens=num_tokens,
            logits=logits,
            hidden_states=hidden if return_hidden_states else None,
            extras=extras,
        )

    def head_loss(
        self, hidden: torch.Tensor, targets: torch.Tensor | None, return_logits: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """LM head and loss of final hidden states: ``(logits, loss, loss_sum, num_tokens)``.

        :func:`xtl.ops.cross_entropy.lm_head_loss` on the head's weight (fused and chunked in training); a method
        so that the ``Compile`` callback can compile it in place.
        """
        return lm_head_loss(hidden, self.lm_head.weight, targets, return_logits)

    def extra_heads(
        self, hidden: torch.Tensor, inputs: ExtraHeadInputs, extras: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The family extras with those of heads that read the final hidden states besides the LM head (none here).

        A family with more prediction heads (DeepSeek-V3's multi-token prediction) overrides this.

        Args:
            hidden: The final, normed hidden states ``(B, T, C)`` (all positions).
            inputs: What the forward saw: embeddings, positions, mask, targets.
            extras: The extras of the decoder layers.
        """
        return extras

    def run_layers(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
        attention_mask: torch.Tensor | None,
        seq_ctx: SequenceContext | None,
        kv_cache: KVCache = NO_KV_CACHE,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the decoder layers; returns the last hidden states and family extras (none for dense models).

        ``attention_mask`` / ``seq_ctx`` are the caller's, for families that need to know which tokens are real;
        layer ``i`` gets ``kv_cache.layer(i)``.
        """
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, position_embeddings, mask, kv_cache.layer(i))
        return hidden, {}


@torch.compiler.disable
def _packed_mask(seq_ctx: SequenceContext) -> AttentionMaskSpec:
    """The attention mask of a packed batch: built eagerly, outside compiled code."""
    return AttentionMaskSpec(
        cu_seq_lens=seq_ctx.cu_seq_lens,
        max_seq_len=seq_ctx.max_seq_len,
        doc_bounds=list(seq_ctx.doc_bounds) if seq_ctx.doc_bounds is not None else None,
    )
