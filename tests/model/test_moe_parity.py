"""Parity of the MoE family (Qwen3-MoE, DeepSeek-V3, GPT-OSS) with transformers' eager implementation.

With ``XTL_HF_IMPL=1`` one MoE decoder layer (output, loss through norm + head, dL/dx) and the whole model
(logits, loss, dL/d inputs_embeds) are ``torch.equal`` to transformers in float32 and bfloat16.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from xtl.model import get_model_config_from_hf
from xtl.module.moe_block import MoEDecoderLayer
from xtl.ops import AttentionMaskSpec

from .parity import assert_head_loss_and_input_grad_equal

_COMMON = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)

# name -> (HF config class, HF model class, config kwargs)
MOE_VARIANTS: dict[str, tuple[type, type, dict]] = {
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
        ),
    ),
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
            q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            },
        ),
    ),
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=6,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64,
            },
        ),
    ),
}  # fmt: skip
VARIANTS = sorted(MOE_VARIANTS)
DTYPES = [torch.float32, torch.bfloat16]


def build_tiny_moe(variant: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """A random transformers MoE model of ``variant`` (eager attention and experts) with non-trivial weights.

    Router weights are scaled up so routing margins are far above rounding noise (no near-ties in top-k), and
    norms, biases, sinks and the correction bias are randomized so no wiring error can hide behind a constant.
    """
    config_cls, model_cls, overrides = MOE_VARIANTS[variant]
    config = config_cls(**{**_COMMON, **overrides}, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("gate.weight", "router.weight")):
                p.mul_(25.0)
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.to(dtype).eval()


@functools.cache
def save_tiny_moe(variant: str, dtype: torch.dtype, root: Path) -> Path:
    """Save :func:`build_tiny_moe` under ``root`` once per (variant, dtype); return the directory."""
    path = root / f"{variant}_{str(dtype).split('.')[-1]}"
    if dtype == torch.float32:
        build_tiny_moe(variant, dtype).save_pretrained(path)
    else:  # as released low-precision checkpoints are made: transformers keeps its fp32-by-design tensors fp32
        fp32 = save_tiny_moe(variant, torch.float32, root)
        AutoModelForCausalLM.from_pretrained(fp32, dtype=dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_moe_dir(variant, dtype=torch.float32) -> Path`` of a saved tiny HF MoE checkpoint."""
    root = tmp_path_factory.mktemp("hf_moe")
    return lambda variant, dtype=torch.float32: save_tiny_moe(variant, dtype, root)


def load_pair(path: Path, dtype: torch.dtype):
    """The transformers model (eager attention and experts) and the xtl model of the checkpoint at ``path``."""
    hf = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", experts_implementation="eager", dtype=dtype
    ).eval()
    with torch.device("meta"):
        model = get_model_config_from_hf(path).build()
    model.from_hf(path)
    return hf, model.to(dtype).eval()


def _moe_layer_cases() -> list[tuple[str, int]]:
    # qwen3_moe: layer 0 is dense (mlp_only_layers); deepseek_v3: layer 0 is dense (first_k_dense_replace);
    # gpt_oss: layer 0 slides, layer 1 is full attention.
    return [("qwen3_moe", 1), ("deepseek_v3", 1), ("gpt_oss", 0), ("gpt_oss", 1)]


@pytest.mark.usefixtures("hf_impl")
class TestMoEDecoderLayerParity:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("variant,layer_idx", _moe_layer_cases())
    def test_layer_output_loss_and_input_grad_are_bitwise(self, tiny_moe_dir, variant, layer_idx, dtype):
        hf, model = load_pair(tiny_moe_dir(variant, dtype), dtype)
        assert isinstance(model.layers[layer_idx], MoEDecoderLayer)
        torch.manual_seed(1)
        ids = torch.randint(0, hf.config.vocab_size, (2, 24))
        labels = torch.randint(0, hf.config.vocab_size, (2, 24))
        x_hf = hf.model.embed_tokens(ids).detach().requires_grad_()  # real hidden states: token embeddings
        x_xtl = x_hf.detach().clone().requires_grad_()
        position_ids = torch.arange(24).unsqueeze(0)

        hf_layer = hf.model.layers[layer_idx]
        sliding = getattr(hf_layer.self_attn, "sliding_window", None) is not None
        mask_fn = create_sliding_window_causal_mask if sliding else create_causal_mask
        mask = mask_fn(
            config=hf.config, inputs_embeds=x_hf, attention_mask=None, cache=None, position_ids=position_ids
        )
        out_hf = hf_layer(
            x_hf,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=hf.model.rotary_emb(x_hf, position_ids),
        )
        out_xtl, routing = model.layers[layer_idx](x_xtl, model.rotary_emb(position_ids, dtype), AttentionMaskSpec())
        assert routing.topk_ids.shape == (48, hf.config.num_experts_per_tok)

        assert_head_loss_and_input_grad_equal(hf, model, out_hf, out_xtl, x_hf, x_xtl, labels)


@pytest.mark.usefixtures("hf_impl")
class TestMoEWholeModelParity:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_logits_loss_and_embedding_grad_are_bitwise(self, tiny_moe_dir, variant, dtype):
        hf, model = load_pair(tiny_moe_dir(variant, dtype), dtype)
        torch.manual_seed(2)
        ids = torch.randint(0, hf.config.vocab_size, (2, 24))
        labels = ids.clone()
        labels[0, :5] = -100
        emb_hf = hf.get_input_embeddings()(ids).detach().requires_grad_()
        emb_xtl = emb_hf.detach().clone().requires_grad_()
        out_hf = hf(inputs_embeds=emb_hf, labels=labels)
        out_xtl = model(inputs_embeds=emb_xtl, labels=labels)
        assert torch.equal(out_hf.logits, out_xtl.logits)
        assert torch.equal(out_hf.loss, out_xtl.loss)  # transformers adds no aux loss without output_router_logits
        out_hf.loss.backward()
        out_xtl.loss.backward()
        assert torch.equal(emb_hf.grad, emb_xtl.grad)

    def test_padding_mask_matches_and_padding_is_not_counted(self, tiny_moe_dir):
        hf, model = load_pair(tiny_moe_dir("gpt_oss"), torch.float32)
        ids = torch.randint(0, hf.config.vocab_size, (2, 16))
        attention_mask = torch.ones_like(ids)
        attention_mask[1, 12:] = 0
        with torch.no_grad():
            out_hf = hf(input_ids=ids, attention_mask=attention_mask)
            out_xtl = model(input_ids=ids, attention_mask=attention_mask)
        assert torch.equal(out_hf.logits[:, :12], out_xtl.logits[:, :12])
        assert int(out_xtl.extras["router_num_tokens"]) == 28
        assert out_xtl.extras["tokens_per_expert"].sum(-1).tolist() == [28 * 2] * 2
