"""Model dimensions read from an xtl config: parameter counts by part and training FLOPs per token.

:class:`ModelDims` is the one place that turns a config into counts. ``xtl memory`` sizes weights, gradients and
optimizer states from it and the ``Throughput`` callback its FLOPs, so both agree for dense, MoE and MLA models.

It reads structural properties, never ``model_type``: the dense switches ``qkv_bias``, ``o_bias``, ``qk_norm``,
``attention_sinks``, ``is_mla`` (with the MLA fields ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``), ``resolved_head_dim`` and ``is_moe_layer(i)``; and the MoE properties
``num_routed_experts``, ``num_experts_per_tok``, ``expert_intermediate_size``,
``shared_experts_intermediate_size``, ``router_bias`` and ``expert_bias``. Each has a default on the family base
(``DenseConfig`` / ``MoEConfig``) that a family overrides.

Example:
    >>> from xtl.model import get_model_config
    >>> dims = ModelDims.from_config(get_model_config("qwen3-30b-a3b"))
    >>> round(dims.parameter_counts()["activated"] / 1e9, 2)
    3.35
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xtl.model.compose.config import Qwen3VLConfig, Qwen3VLVisionConfig
    from xtl.model.dense.config import DenseConfig


@dataclass(frozen=True)
class ModelDims:
    """Architecture dimensions of a decoder-only LM.

    Attributes:
        vocab_size: Vocabulary size.
        hidden_size: Model width h.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (GQA).
        head_dim: Per-head width of MHA/GQA (unused by MLA).
        intermediate_size: Width of a dense MLP (of every layer that is not MoE).
        tie_word_embeddings: The LM head shares the embedding weight.
        qkv_bias: Bias on the q/k/v projections (MLA: on ``q_a`` and ``kv_a``).
        o_bias: Bias on the attention output projection.
        qk_norm: Per-head RMSNorm on queries and keys.
        attention_sinks: A learned sink logit per head.
        mlp_bias: Bias on the dense MLP projections.
        q_lora_rank: MLA query LoRA rank (0: full query projection).
        kv_lora_rank: MLA key/value latent rank (0: not MLA).
        qk_nope_head_dim: MLA non-rotary query/key dims per head.
        qk_rope_head_dim: MLA rotary query/key dims per head.
        v_head_dim: MLA value dims per head.
        num_experts: Routed experts per MoE layer (0: dense model).
        experts_per_token: Routed experts a token activates (top-k).
        moe_intermediate_size: Width of one routed expert.
        shared_intermediate_size: Width of the always-on shared-expert MLP (0: none).
        moe_layers: Indices of the layers whose MLP is a mixture of experts (``None``: every layer).
        router_bias: The router has a per-expert bias (a gate bias, or DeepSeek's score-correction bias).
        expert_bias: Routed experts have biases on their projections.
        sliding_windows: Per-layer attention window (``None``: full causal); empty means all full.
        mtp_layers: Multi-token-prediction depths trained with the model (DeepSeek-V3 ``mtp_layers``); depth ``k``
            is a decoder layer of index ``num_layers + k`` plus two input norms, the ``2h -> h`` projection and an
            output norm, and runs the shared LM head once more.
        head_outputs: Outputs of the head: 0 for an LM head (``vocab_size``); the labels of a sequence-classification
            head (a reward model's scalar head: 1), never tied to the embedding.
        name: Display name.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    attention_sinks: bool = False
    mlp_bias: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    moe_layers: tuple[int, ...] | None = None
    router_bias: bool = False
    expert_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    mtp_layers: int = 0
    head_outputs: int = 0
    name: str = "model"

    @classmethod
    def from_config(cls, config: DenseConfig, name: str | None = None) -> ModelDims:
        """Read the dimensions of an xtl model config (dense, MoE, MLA).

        Args:
            config: A dense or MoE family config (e.g. ``xtl.model.get_model_config("qwen3-8b")``); for a
                vision-language config, its language model's (:class:`VisionDims` counts the vision tower).
            name: Display name (default: the config class name).

        Returns:
            The dimensions.
        """
        config = config.language_config
        windows = tuple(config.layer_sliding_window(i) for i in range(config.num_hidden_layers))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=config.resolved_head_dim,
            intermediate_size=config.intermediate_size,
            tie_word_embeddings=config.tie_word_embeddings,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm=config.qk_norm,
            attention_sinks=config.attention_sinks,
            mlp_bias=config.mlp_bias,
            sliding_windows=windows if any(w is not None for w in windows) else (),
            mtp_layers=config.mtp_layers,
            head_outputs=config.num_labels or 0,
            name=name or type(config).__name__,
            **_mla_fields(config),
            **_moe_fields(config),
        )

    @property
    def is_moe(self) -> bool:
        """bool: Whether the MLP of (some) layers is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or len(self.moe_layers) > 0)

    @property
    def is_mla(self) -> bool:
        """bool: Whether attention is multi-head latent attention (DeepSeek)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """int: Query/key width per head (MLA: non-rotary plus rotary dims)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """int: Value width per head."""
        return self.v_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) has routed experts (else a dense MLP of ``intermediate_size``).

        Args:
            layer: Layer index.

        Returns:
            True for an MoE layer.
        """
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    # ---- parameter counts -------------------------------------------------------------------------------------

    def embedding_params(self) -> int:
        """int: Token embedding parameters."""
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """int: Final norm plus the head: the LM head (its weight not counted again when tied to the embedding), or a
        sequence-classification head of ``head_outputs`` rows."""
        if self.head_outputs:
            return self.hidden_size + self.head_outputs * self.hidden_size
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def attention_params(self) -> int:
        """int: Attention parameters of one layer, including its input RMSNorm."""
        h, a = self.hidden_size, self.num_heads
        if self.is_mla:
            if self.q_lora_rank:  # q_a (+ bias), q_a norm, q_b
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * a * self.qk_head_dim
                q += self.q_lora_rank if self.qkv_bias else 0
            else:
                q = h * a * self.qk_head_dim
            kv_a = self.kv_lora_rank + self.qk_rope_head_dim
            kv = h * kv_a + (kv_a if self.qkv_bias else 0) + self.kv_lora_rank  # kv_a (+ bias), kv_a norm
            kv += self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b
            proj = q + kv + a * self.v_head_dim * h + (h if self.o_bias else 0)
        else:
            qd, kd = a * self.head_dim, self.num_kv_heads * self.head_dim
            proj = 2 * h * qd + 2 * h * kd + (qd + 2 * kd if self.qkv_bias else 0) + (h if self.o_bias else 0)
            proj += 2 * self.head_dim if self.qk_norm else 0
        return h + proj + (a if self.attention_sinks else 0)

    def expert_params(self, layer: int) -> int:
        """Routed-expert parameters of one layer (what expert parallelism shards); 0 for a dense layer.

        Args:
            layer: Layer index.

        Returns:
            Parameter count of all routed experts of the layer.
        """
        if not self.is_moe_layer(layer):
            return 0
        h, i, e = self.hidden_size, self.moe_intermediate_size, self.num_experts
        return e * 3 * h * i + (e * (2 * i + h) if self.expert_bias else 0)

    def mlp_params(self, layer: int, activated: bool = False) -> int:
        """MLP parameters of one layer, including its post-attention RMSNorm, router and shared experts.

        Args:
            layer: Layer index.
            activated: Count only the routed experts one token activates (top-k of all).

        Returns:
            Parameter count.
        """
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            i = self.intermediate_size
            return h + 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        experts = self.expert_params(layer)
        if activated:
            experts = experts * self.experts_per_token // self.num_experts
        router = self.num_experts * h + (self.num_experts if self.router_bias else 0)
        return h + router + 3 * h * self.shared_intermediate_size + experts

    def mtp_layer_indices(self) -> range:
        """range: Layer indices of the multi-token-prediction depths (after the decoder layers)."""
        return range(self.num_layers, self.num_layers + self.mtp_layers)

    def mtp_params(self, activated: bool = False) -> int:
        """Parameters of the MTP depths: per depth a decoder layer, ``enorm``, ``hnorm``, ``eh_proj`` (``2h x h``)
        and the output norm (the embedding and the LM head are the model's).

        Args:
            activated: Count only the routed experts one token activates.

        Returns:
            Parameter count (0 without MTP).
        """
        h = self.hidden_size
        own = 3 * h + 2 * h * h + self.attention_params()
        return sum(own + self.mlp_params(i, activated) for i in self.mtp_layer_indices())

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part.

        Returns:
            ``embedding``, ``attention`` (all layers), ``mlp`` (all layers, routed experts included), ``experts``
            (the routed share of ``mlp``), ``head`` (final norm + untied LM head), ``total`` and ``activated``
            (what one token uses: top-k routed experts instead of all; the embedding included); with MTP depths
            also ``mtp`` (their parameters, routed experts included; part of ``total``) and ``mtp_experts``.
        """
        layers = range(self.num_layers)
        embedding, head = self.embedding_params(), self.head_params()
        attention = self.attention_params() * self.num_layers
        mlp = sum(self.mlp_params(i) for i in layers)
        activated_mlp = sum(self.mlp_params(i, activated=True) for i in layers)
        counts = {
            "embedding": embedding,
            "attention": attention,
            "mlp": mlp,
            "experts": sum(self.expert_params(i) for i in layers),
            "head": head,
            "total": embedding + attention + mlp + head,
            "activated": embedding + attention + activated_mlp + head,
        }
        if self.mtp_layers:
            counts["mtp"] = self.mtp_params()
            counts["mtp_experts"] = sum(self.expert_params(i) for i in self.mtp_layer_indices())
            counts["total"] += counts["mtp"]
            counts["activated"] += self.mtp_params(activated=True)
        return counts

    # ---- FLOPs ------------------------------------------------------------------------------------------------

    def compute_params(self) -> int:
        """int: Activated parameters a token is multiplied with: all but the embedding, the LM head even when tied,
        and once more per MTP depth."""
        counts = self.parameter_counts()
        tied_head = self.vocab_size * self.hidden_size if self.tie_word_embeddings and not self.head_outputs else 0
        return (
            counts["activated"]
            - counts["embedding"]
            + tied_head
            + self.mtp_layers * self.vocab_size * self.hidden_size
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token of sequences of ``seq_len`` tokens.

        ``6 * N + sum over layers of 6 * heads * (d_qk + d_v) * c_l``: a weight of ``N`` elements costs 2 FLOPs per
        token forward and 4 backward, with ``N`` = :meth:`compute_params` (top-k routed plus shared experts and the
        router for MoE). Attention scores (``q k^T``) and values (``p v``) cost ``2 * heads * (d_qk + d_v)`` per
        attended key forward, three times that for training; a query attends on average to ``c_l = L / 2`` keys
        under causal masking, ``w - w^2 / (2 L)`` with a sliding window ``w < L``. MHA/GQA use ``d_qk = d_v =
        head_dim``; MLA uses ``d_qk = qk_nope_head_dim + qk_rope_head_dim`` and ``d_v = v_head_dim``.

        Args:
            seq_len: Tokens per sequence ``L``.

        Returns:
            FLOPs per token.
        """
        windows = self.sliding_windows or (None,) * self.num_layers
        keys = sum(_mean_attended_keys(seq_len, w) for w in windows) + self.mtp_layers * seq_len / 2
        return 6.0 * self.compute_params() + 6.0 * self.num_heads * (self.qk_head_dim + self.v_dim) * keys


@dataclass(frozen=True)
class VisionDims:
    """Dimensions of a Qwen3-VL vision tower, for its training FLOPs per image.

    Attributes:
        depth: Vision blocks.
        hidden_size: Block width C.
        intermediate_size: Block MLP width.
        patch_dim: Values per flattened patch (``in_channels * temporal_patch_size * patch_size**2``).
        spatial_merge_size: m (``m x m`` patches make one LM token).
        out_hidden_size: LM width the mergers project to.
        num_mergers: The final merger plus one per DeepStack layer.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    patch_dim: int
    spatial_merge_size: int
    out_hidden_size: int
    num_mergers: int

    @classmethod
    def from_config(cls, config: Qwen3VLVisionConfig | Qwen3VLConfig) -> VisionDims:
        """Read a vision config (:class:`xtl.model.compose.Qwen3VLVisionConfig`, or a VLM config's
        ``vision_config``)."""
        from xtl.model.compose.config import Qwen3VLConfig

        c = config.vision_config if isinstance(config, Qwen3VLConfig) else config
        return cls(
            depth=c.depth,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            patch_dim=c.in_channels * c.temporal_patch_size * c.patch_size**2,
            spatial_merge_size=c.spatial_merge_size,
            out_hidden_size=c.out_hidden_size,
            num_mergers=1 + len(c.deepstack_visual_indexes),
        )

    def flops_per_image(self, t: int, h: int, w: int) -> float:
        """Training FLOPs of one image of ``t x h x w`` patches (its ``image_grid_thw`` row).

        Weights cost 6 FLOPs per element and row, as in :meth:`ModelDims.flops_per_token`: the patch embedding
        and the blocks (``4 C^2`` attention, ``2 C I`` MLP) per patch, the mergers (``M^2 + M * out`` with
        ``M = C m^2``) per merged token. Attention is bidirectional within a frame: ``12 C`` per attended key
        and patch in each block, every patch attending to the ``h * w`` patches of its frame.
        """
        c, merge = self.hidden_size, self.spatial_merge_size**2
        patches = t * h * w
        per_patch = self.patch_dim * c + self.depth * (4 * c * c + 2 * c * self.intermediate_size)
        merged = c * merge
        per_token = self.num_mergers * (merged * merged + merged * self.out_hidden_size)
        weights = 6.0 * (patches * per_patch + patches / merge * per_token)
        return weights + 12.0 * self.depth * c * patches * h * w


def _mla_fields(config: DenseConfig) -> dict[str, int]:
    """MLA dimensions of a family whose ``is_mla`` property is true (none otherwise)."""
    if not config.is_mla:
        return {}
    return {
        "q_lora_rank": config.q_lora_rank or 0,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
    }


def _moe_fields(config: DenseConfig) -> dict[str, int | bool | tuple[int, ...]]:
    """Expert dimensions of an MoE family config with at least one MoE layer (none otherwise); MTP depths count as
    layers after the last one."""
    depths = config.mtp_layers
    moe_layers = tuple(filter(config.is_moe_layer, range(config.num_hidden_layers + depths)))
    if not moe_layers:
        return {}
    return {
        "num_experts": config.num_routed_experts,
        "experts_per_token": config.num_experts_per_tok,
        "moe_intermediate_size": config.expert_intermediate_size,
        "shared_intermediate_size": config.shared_experts_intermediate_size,
        "moe_layers": moe_layers,
        "router_bias": config.router_bias,
        "expert_bias": config.expert_bias,
    }


def _mean_attended_keys(seq_len: int, window: int | None) -> float:
    """Mean keys a query attends to under causal masking (area of the band below the diagonal / ``seq_len``)."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


__all__ = ["ModelDims", "VisionDims"]
