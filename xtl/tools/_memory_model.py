"""Architecture dimensions and per-part parameter / activation formulas used by ``xtl memory``.

Activation accounting (elements per token, stored in the activation dtype unless marked fp32) is what a fused
training implementation keeps for backward: fused RMSNorm keeps its input plus an fp32 ``rstd`` per row and its
output is kept by the consumer linear; RoPE keeps nothing but cos/sin; flash attention keeps q, k, v, its output
and the fp32 log-sum-exp per head; fused SwiGLU keeps gate and up and the down projection keeps its input. The
derivation of every term is in ``docs/tools.md`` and ``xtl memory --measure`` checks it against autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

from xtl.tools._cli import ToolInputError

FP32 = 4
INDEX_BYTES = 8


@dataclass(frozen=True)
class ModelDims:
    """Architecture dimensions of a decoder-only LM, read from HF ``config.json`` fields."""

    name: str
    model_type: str
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
    attn_sinks: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    first_dense_layers: int = 0
    router_bias: bool = False
    expert_bias: bool = False

    @property
    def is_moe(self) -> bool:
        """bool: Whether the MLP of (some) layers is a mixture of experts."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """bool: Whether attention is multi-head latent attention (DeepSeek)."""
        return self.kv_lora_rank > 0

    @classmethod
    def from_hf(cls, name: str, cfg: dict) -> ModelDims:
        """Build from HF ``config.json`` fields (dense, Qwen3-MoE, DeepSeek-V3 MLA/MoE, GPT-OSS).

        Args:
            name (str): Display name.
            cfg (dict): HF config fields.

        Returns:
            ModelDims: The dimensions.
        """
        cfg = dict(cfg.get("text_config") or cfg)
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            mt = str(cfg.get("model_type", ""))
            experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
            moe_inter = int(cfg.get("moe_intermediate_size") or (cfg["intermediate_size"] if experts else 0))
            shared = int(cfg.get("shared_expert_intermediate_size") or 0)
            shared += int(cfg.get("n_shared_experts") or 0) * moe_inter
            bias = bool(cfg.get("attention_bias", False))
            return cls(
                name=name,
                model_type=mt,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=h,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or h // heads),
                intermediate_size=int(cfg.get("intermediate_size") or 0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bias or mt in {"qwen2", "qwen2_moe"},
                o_bias=bias,
                qk_norm=mt in {"qwen3", "qwen3_moe"},
                attn_sinks=mt == "gpt_oss",
                q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
                qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
                qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
                v_head_dim=int(cfg.get("v_head_dim") or 0),
                num_experts=experts,
                experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
                moe_intermediate_size=moe_inter,
                shared_intermediate_size=shared,
                first_dense_layers=int(cfg.get("first_k_dense_replace") or 0) if experts else 0,
                router_bias=mt in {"gpt_oss", "deepseek_v3"},
                expert_bias=mt == "gpt_oss",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ToolInputError(f"config of {name} lacks or has an invalid field: {exc}") from exc

    def is_dense_layer(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) has a dense MLP.

        Args:
            layer (int): Layer index.

        Returns:
            bool: True for a dense MLP.
        """
        return not self.is_moe or layer < self.first_dense_layers

    # ---- parameter counts -------------------------------------------------------------------------------------
    def embed_params(self) -> int:
        """int: Token embedding parameters."""
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """int: Final norm plus LM head (the head weight is not counted again when tied to the embedding)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def attn_params(self) -> int:
        """int: Attention parameters of one layer, including its input RMSNorm."""
        h, a = self.hidden_size, self.num_heads
        if self.is_mla:
            qh = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * a * qh
            else:
                q = h * a * qh
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim)
            proj = q + kv + a * self.v_head_dim * h
        else:
            qd, kd = a * self.head_dim, self.num_kv_heads * self.head_dim
            proj = 2 * h * qd + 2 * h * kd + (qd + 2 * kd if self.qkv_bias else 0) + (h if self.o_bias else 0)
            proj += 2 * self.head_dim if self.qk_norm else 0
        return h + proj + (a if self.attn_sinks else 0)

    def expert_params(self, layer: int) -> int:
        """Routed-expert parameters of one layer (sharded by expert parallelism); 0 for a dense layer.

        Args:
            layer (int): Layer index.

        Returns:
            int: Parameter count.
        """
        if self.is_dense_layer(layer):
            return 0
        h, i, e = self.hidden_size, self.moe_intermediate_size, self.num_experts
        return e * 3 * h * i + (e * (2 * i + h) if self.expert_bias else 0)

    def mlp_params(self, layer: int, experts_per_token: bool = False) -> int:
        """MLP parameters of one layer, including its post-attention RMSNorm, router and shared experts.

        Args:
            layer (int): Layer index.
            experts_per_token (bool): Count only the experts a token activates (activated parameters).

        Returns:
            int: Parameter count.
        """
        h = self.hidden_size
        if self.is_dense_layer(layer):
            return h + 3 * h * self.intermediate_size
        experts = self.expert_params(layer)
        if experts_per_token:
            experts = experts * self.experts_per_token // self.num_experts
        router = self.num_experts * h + (self.num_experts if self.router_bias else 0)
        return h + router + 3 * h * self.shared_intermediate_size + experts

    # ---- activations (bytes per token of one micro-batch, full tensor before tp) ------------------------------
    def attn_act_bytes(self, act: int, flash: bool) -> float:
        """Bytes one token keeps for the backward of one attention block (excluding the O(L^2) part).

        Args:
            act (int): Activation dtype size in bytes.
            flash (bool): Flash attention (keeps an fp32 log-sum-exp per head).

        Returns:
            float: Bytes per token.
        """
        h, a = self.hidden_size, self.num_heads
        norm = 2 * h * act + FP32  # input, output (kept by the q/k/v projections), rstd
        if self.is_mla:
            qh = self.qk_nope_head_dim + self.qk_rope_head_dim
            lora = (2 * self.q_lora_rank + 2 * self.kv_lora_rank) * act  # q_a / kv_a norm inputs and outputs
            lora += FP32 * ((1 if self.q_lora_rank else 0) + 1)  # q_a / kv_a norm rstd
            core = (2 * a * qh + 2 * a * self.v_head_dim) * act  # q, k, v, output
            return norm + lora + core + (a * FP32 if flash else 0)
        qd, kd = a * self.head_dim, self.num_kv_heads * self.head_dim
        qk_norm = ((qd + kd) * act + (a + self.num_kv_heads) * FP32) if self.qk_norm else 0
        core = (qd + kd + kd + qd) * act  # q and k after RoPE, v, output (o_proj input)
        return norm + qk_norm + core + (a * FP32 if flash else 0)

    def attn_score_bytes(self, act: int, seq_len: int) -> float:
        """Bytes per token for the softmax probabilities kept without flash attention (``heads * L`` per token).

        Args:
            act (int): Activation dtype size in bytes.
            seq_len (int): Sequence length.

        Returns:
            float: Bytes per token.
        """
        return self.num_heads * seq_len * act

    def mlp_act_bytes(self, layer: int, act: int, capacity: float = 1.0) -> float:
        """Bytes one token keeps for the backward of one MLP / MoE block, with its post-attention norm.

        Args:
            layer (int): Layer index.
            act (int): Activation dtype size in bytes.
            capacity (float): Expert capacity factor (token share an expert-parallel rank receives).

        Returns:
            float: Bytes per token.
        """
        h = self.hidden_size
        norm = 2 * h * act + FP32
        if self.is_dense_layer(layer):
            return norm + 3 * self.intermediate_size * act  # gate, up, down input
        k, i = self.experts_per_token, self.moe_intermediate_size
        router = self.num_experts * FP32 + k * (FP32 + INDEX_BYTES)  # scores, top-k weights, permutation indices
        routed = capacity * k * (h + 3 * i) * act  # permuted input, gate, up, down input
        combine = k * h * act  # expert outputs, needed for the gradient of the top-k weights
        shared = 3 * self.shared_intermediate_size * act
        return norm + router + routed + combine + shared

    def head_act_bytes(self, act: int) -> float:
        """Bytes per token for the final norm and LM-head input (the loss logits are counted separately).

        Args:
            act (int): Activation dtype size in bytes.

        Returns:
            float: Bytes per token.
        """
        return 2 * self.hidden_size * act + FP32

    def loss_bytes(self, tokens: int) -> float:
        """Bytes of the fp32 log-probabilities kept by the cross-entropy for ``tokens`` tokens.

        Args:
            tokens (int): Tokens whose logits are alive at once (a chunk with chunked loss).

        Returns:
            float: Bytes.
        """
        return tokens * self.vocab_size * FP32
