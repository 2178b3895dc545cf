"""DeepSeek-V3: multi-head latent attention, aux-loss-free group-limited sigmoid routing, shared experts."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DeepseekV3Config

from xtl.batch import SequenceContext
from xtl.model.dense.dense import ExtraHeadInputs
from xtl.model.hf.errors import CheckpointError
from xtl.model.moe.config import MoEConfig
from xtl.model.moe.moe import MoE, router_token_mask
from xtl.module.mla import MultiLatentAttention
from xtl.module.moe_block import MoEBlock
from xtl.module.mtp import MTPBlock, shift_in_pack, shift_within_documents, shifted_targets
from xtl.module.rope import RopeConfig
from xtl.module.router import NoAuxTopKRouter, Router
from xtl.ops.cross_entropy import IGNORE_INDEX
from xtl.ops.moe_loss import router_statistics

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_MTP_KEY = re.compile(r"mtp\.(\d+)\.(.+)")
_ROUTER_EXTRAS = ("router_prob_sum", "router_z_sum", "tokens_per_expert")


@dataclass
class DeepSeekV3Config(MoEConfig):
    """DeepSeek-V3 family (``model_type='deepseek_v3'``).

    The first ``first_k_dense_replace`` layers are dense; the others route to ``n_routed_experts`` experts in
    ``n_group`` groups (``topk_group`` usable per token) and add ``n_shared_experts`` always-on experts.

    Multi-token prediction (MTP): ``num_mtp_layers`` (transformers' name of ``num_nextn_predict_layers``) says how
    many MTP layers the checkpoint holds (``model.layers.{num_hidden_layers + k}...``); ``mtp_layers`` of them are
    built and trained (0, the default: none, and the checkpoint's MTP layers are ignored on load).

    Attributes:
        mtp_layers: MTP depths to build and train (xtl's own field; at most ``num_mtp_layers``).
        mtp_loss_weight: Weight of the MTP loss: the training loss is the next-token loss plus ``mtp_loss_weight``
            times the mean over depths of each depth's cross-entropy (DeepSeek-V3: 0.3, later 0.1).
    """

    hf_config_class = DeepseekV3Config
    hf_architecture = "DeepseekV3ForCausalLM"

    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int | None = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    first_k_dense_replace: int | None = 3
    pretraining_tp: int | None = 1
    rope_interleave: bool | None = True
    num_mtp_layers: int = 1
    output_router_logits: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        self.head_dim = self.qk_rope_head_dim  # the rotary width, as transformers derives it
        if not 0 <= self.mtp_layers <= max(self.num_mtp_layers or 0, 0):
            raise ValueError(
                f"mtp_layers: {self.mtp_layers} is not within 0..num_mtp_layers ({self.num_mtp_layers}, the MTP "
                "layers of the checkpoint); lower mtp_layers or raise num_mtp_layers"
            )
        if self.mtp_loss_weight < 0:
            raise ValueError(f"mtp_loss_weight: {self.mtp_loss_weight} is negative; use a weight >= 0 (e.g. 0.3)")

    @property
    def num_routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def shared_experts_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def router_bias(self) -> bool:
        """The router keeps a per-expert score-correction bias (a checkpoint tensor)."""
        return True

    @property
    def is_mla(self) -> bool:
        """Attention is multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_*_head_dim``, ...)."""
        return True

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale**2`` for scaled rotary with ``mscale_all_dim`` (transformers)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        mscale_all_dim = self.rope.params.get("mscale_all_dim", 0)
        factor = self.rope.params.get("factor", 1.0)
        if self.rope.rope_type != "default" and mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers from ``first_k_dense_replace`` on are MoE."""
        return layer_idx >= (self.first_k_dense_replace or 0)

    def build_router(self) -> Router:
        """Sigmoid, group-limited, aux-loss-free router."""
        return NoAuxTopKRouter(
            self.hidden_size,
            self.n_routed_experts,
            self.num_experts_per_tok,
            n_group=self.n_group or 1,
            topk_group=self.topk_group or 1,
            norm_topk_prob=bool(self.norm_topk_prob),
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def build(self) -> DeepSeekV3:
        """Build the DeepSeek-V3 model."""
        return DeepSeekV3(self)


class DeepSeekV3(MoE):
    """:class:`MoE` with multi-head latent attention and ``config.mtp_layers`` multi-token-prediction depths.

    MTP depth ``k`` (:class:`~xtl.module.mtp.MTPBlock` ``mtp[k-1]``) is built like decoder layer
    ``num_hidden_layers + k - 1`` and shares the embedding and the LM head with the model. A forward with targets
    runs the depths after the main model and adds to ``extras``:

    - ``mtp_loss_sum`` ``(D,)`` fp32, differentiable: depth ``k``'s summed cross-entropy of token ``t + k + 1`` at
      each position ``t`` whose target is supervised and in ``t``'s document.
    - ``mtp_num_tokens`` ``(D,)`` int64: the positions each depth scores.

    The router statistics of MTP depths with experts follow those of the decoder layers (the order of
    :meth:`moe_blocks`); a forward that does not run the depths gives them zero rows.

    Checkpoint keys: a depth's own weights are ``model.layers.{num_hidden_layers + k - 1}.{enorm, hnorm, eh_proj,
    shared_head.norm}`` plus its decoder layer's keys. The checkpoint's per-depth ``embed_tokens`` and
    ``shared_head.head`` copies must equal the model's embedding and head (they load into the shared tensors) and
    are written back as copies.
    """

    config: DeepSeekV3Config

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__(config)
        base = config.num_hidden_layers
        self.mtp = nn.ModuleList(
            MTPBlock(self.build_layer(base + k), config.hidden_size, config.rms_norm_eps, config.norm_class)
            for k in range(config.mtp_layers)
        )

    # ---- parts: the MTP depths are blocks of their own stack ------------------------------------------------

    def layer_stacks(self) -> dict[str, nn.ModuleList]:
        """``language`` (the decoder layers), then ``mtp`` (the MTP depths, when built)."""
        stacks = super().layer_stacks()
        return {**stacks, "mtp": self.mtp} if len(self.mtp) else stacks

    def attention_modules(self) -> list[nn.Module]:
        """The self-attention of every decoder layer, then of every MTP depth."""
        return super().attention_modules() + [block.layer.self_attn for block in self.mtp]

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks of the decoder layers, then those of the MTP depths."""
        return super().moe_blocks() + [block.layer.mlp for block in self.mtp if block.routed]

    # ---- multi-token prediction ----------------------------------------------------------------------------

    def extra_heads(
        self, hidden: torch.Tensor, inputs: ExtraHeadInputs, extras: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Run the MTP depths on ``hidden`` when there are targets; see the class docstring."""
        routed = [block for block in self.mtp if block.routed]
        if inputs.targets is None:
            return self._with_mtp_router_rows(extras, [None] * len(routed))
        token_mask = router_token_mask(hidden, inputs.attention_mask, inputs.seq_ctx)
        share = inputs.seq_ctx if inputs.seq_ctx is not None and inputs.seq_ctx.pack_input_ids is not None else None
        stats, loss_sums, counts = [], [], []
        for depth, block in enumerate(self.mtp, start=1):
            embeds = self._mtp_embeds(inputs, share, depth)
            hidden, routing = block(hidden, embeds, inputs.position_embeddings, inputs.mask)
            if routing is not None:
                stats.append(router_statistics(routing.logits, routing.probs, routing.topk_ids, token_mask))
            targets = shifted_targets(inputs.targets, inputs.position_ids, depth, share)
            scored = hidden
            if inputs.rows is not None:  # the rows whose target `depth` tokens later is supervised, and fillers
                scored, targets = self._mtp_rows(hidden, targets, inputs.rows, depth, share is not None)
            _, _, loss_sum, num_tokens = self.head_loss(scored, targets, False)
            loss_sums.append(loss_sum.float())
            counts.append(num_tokens)
        extras = self._with_mtp_router_rows(extras, stats)
        if loss_sums:
            extras = {**extras, "mtp_loss_sum": torch.stack(loss_sums), "mtp_num_tokens": torch.stack(counts)}
        return extras

    def _mtp_embeds(self, inputs: ExtraHeadInputs, share: SequenceContext | None, depth: int) -> torch.Tensor:
        """The embedding of token ``t + depth`` at each position ``t`` (zeros where it is in another document); a
        context-parallel share embeds the tokens past its end from the whole pack's ids."""
        if share is None:
            return shift_within_documents(inputs.embeds, inputs.position_ids, depth)
        ids = shift_in_pack(share.pack_input_ids, share, depth, fill=-1)
        embeds = self.embed_tokens(ids.clamp(min=0))
        return torch.where((ids >= 0)[..., None], embeds, embeds.new_zeros(()))

    @staticmethod
    def _mtp_rows(
        hidden: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, depth: int, share: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states and targets of the positions depth ``depth`` can score, from the supervised ``rows``.

        Position ``t`` scores the label of ``t + depth``, so the candidates are ``rows - depth``; one before the
        start is a filler with no target. On one process (or a whole pack) fillers become the last position, which
        never has a target; a context-parallel share's last ``depth`` positions score labels of the next share (not
        in ``rows``), so a share adds them and masks its fillers' targets instead.
        """
        rows, length = rows - depth, hidden.shape[1]
        if not share:
            rows = torch.where(rows >= 0, rows, length - 1)  # the last position never has a target
            return hidden.index_select(1, rows), targets.index_select(1, rows)
        rows = torch.cat([rows, torch.arange(max(length - depth, 0), length, device=rows.device)])
        picked = targets.index_select(1, rows.clamp(min=0))
        return hidden.index_select(1, rows.clamp(min=0)), torch.where(rows >= 0, picked, IGNORE_INDEX)

    def _with_mtp_router_rows(
        self, extras: dict[str, torch.Tensor], stats: list[tuple[torch.Tensor, ...] | None]
    ) -> dict[str, torch.Tensor]:
        """The router extras with one more row per routed MTP depth (zeros where the depth did not run)."""
        if not stats:
            return extras
        rows = {name: [extras[name]] for name in _ROUTER_EXTRAS}
        for stat in stats:
            for name, main in zip(_ROUTER_EXTRAS, (extras[n] for n in _ROUTER_EXTRAS)):
                rows[name].append(main.new_zeros((1, *main.shape[1:])))
            if stat is not None:
                for name, value in zip(_ROUTER_EXTRAS, stat):
                    rows[name][-1] = value.unsqueeze(0).to(rows[name][0].dtype)
        return {**extras, **{name: torch.cat(parts) for name, parts in rows.items()}}

    def build_attention(self, layer_idx: int) -> nn.Module:
        """Multi-head latent attention (latent norms use transformers' fixed eps of 1e-6)."""
        cfg = self.config
        return MultiLatentAttention(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            scaling=cfg.softmax_scale,
            bias=cfg.attention_bias,
            rope_interleave=bool(cfg.rope_interleave),
            latent_norm_eps=1e-6,
            attn_impl=cfg.attn_impl,
            dropout=cfg.attention_dropout,
        )

    # ---- HF key mapping: MTP depths are the checkpoint's layers after the last decoder layer -----------------

    def to_hf_key_list(self, key: str) -> list[str]:
        """MTP keys map to ``model.layers.{num_hidden_layers + k}``; the embedding and the head also to each built
        depth's ``embed_tokens`` / ``shared_head.head`` copy."""
        keys = super().to_hf_key_list(self._layer_key(key))
        layers = [f"model.layers.{self.config.num_hidden_layers + k}" for k in range(len(self.mtp))]
        tied = self.config.tie_word_embeddings
        if key == "embed_tokens.weight":
            keys += [f"{layer}.embed_tokens.weight" for layer in layers]
            keys += [f"{layer}.shared_head.head.weight" for layer in layers] if tied else []
        elif key == "lm_head.weight" and not tied:
            keys += [f"{layer}.shared_head.head.weight" for layer in layers]
        return keys

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The layout hooks of :class:`MoE` on MTP keys; the embedding and head copies of the MTP depths must equal
        the model's.

        Raises:
            CheckpointError: A depth's ``embed_tokens`` / ``shared_head.head`` differs from the model's.
        """
        if key in ("embed_tokens.weight", "lm_head.weight") and len(tensors) > 1:
            names = self.to_hf_key_list(key)
            for name, copy in zip(names[1:], tensors[1:]):
                if not torch.equal(copy, tensors[0]):
                    raise CheckpointError(
                        f"{name} differs from {names[0]}: xtl shares the embedding and the head with the MTP "
                        "layers; make the copies equal or set mtp_layers: 0"
                    )
            return tensors[0]
        return super().hf_to_param(self._layer_key(key), tensors)

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of :meth:`hf_to_param`: the embedding and the head with one copy per MTP key."""
        if key in ("embed_tokens.weight", "lm_head.weight"):
            count = len(self.to_hf_key_list(key))
            return [tensor] + [tensor.clone() for _ in range(count - 1)]
        return super().param_to_hf(self._layer_key(key), tensor)

    def hf_matrix_rows(self, key: str, rows: int) -> tuple[int, ...]:
        """An MTP depth's matrices split as those of the decoder layer whose HF keys it has."""
        if self.fused_param_parts(key):
            return super().hf_matrix_rows(key, rows)
        return super().hf_matrix_rows(self._layer_key(key), rows)

    def _layer_key(self, key: str) -> str:
        """The xtl key of an MTP parameter written as a key of layer ``num_hidden_layers + k`` (HF's names)."""
        match = _MTP_KEY.fullmatch(key)
        if match is None:
            return key
        rest = match[2]
        if rest.startswith("layer."):
            rest = rest.removeprefix("layer.")
        elif rest.startswith("norm."):
            rest = f"shared_head.{rest}"
        return f"layers.{self.config.num_hidden_layers + int(match[1])}.{rest}"

    def ignorable_hf_key(self, key: str) -> bool:
        """Also the checkpoint's MTP layers beyond the built depths."""
        match = _LAYER_KEY.match(key)
        if match and int(match[1]) >= self.config.num_hidden_layers + len(self.mtp):
            return True  # MTP layers of the checkpoint that are not built
        return super().ignorable_hf_key(key)


@dataclass
class DeepSeekV3_671BConfig(DeepSeekV3Config):
    """DeepSeek-V3 (671B total, 37B active)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    num_experts_per_tok: int = 8
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    dtype: str | None = "bfloat16"
    rope: RopeConfig = field(
        default_factory=lambda: RopeConfig(
            rope_type="yarn",
            rope_theta=10000.0,
            params={
                "factor": 40.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
        )
    )
