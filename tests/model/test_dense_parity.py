"""Bitwise parity of the dense family with transformers' eager implementation (``XTL_HF_IMPL=1``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from xtl.model import get_model_config_from_hf
from xtl.ops import AttentionMaskSpec

from .parity import assert_head_loss_and_input_grad_equal

VARIANTS = [
    "llama",
    "llama_llama3_rope",
    "llama_linear_rope",
    "llama_dynamic_rope",
    "qwen2",
    "qwen2_tied",
    "qwen3",
    "qwen3_tied",
    "qwen3_yarn",
    "qwen3_sliding",
]
DTYPES = [torch.float32, torch.bfloat16]


def _load_pair(path, dtype):
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()
    with torch.device("meta"):
        model = get_model_config_from_hf(path).build()
    model.from_hf(path)
    return hf, model.to(dtype).eval()


@pytest.mark.usefixtures("hf_impl")
class TestDecoderLayerParity:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize(
        "variant",
        ["llama", "llama_llama3_rope", "qwen2", "qwen2_tied", "qwen3", "qwen3_tied", "qwen3_yarn", "qwen3_sliding"],
    )
    def test_layer_output_loss_and_input_grad_are_bitwise(self, tiny_hf_dir, variant, dtype):
        path = tiny_hf_dir(variant, dtype)
        hf, model = _load_pair(path, dtype)
        torch.manual_seed(1)
        ids = torch.randint(0, hf.config.vocab_size, (2, 24))
        labels = torch.randint(0, hf.config.vocab_size, (2, 24))
        # real hidden states: the embeddings of real tokens
        x_hf = hf.model.embed_tokens(ids).detach().requires_grad_()
        x_xtl = x_hf.detach().clone().requires_grad_()
        position_ids = torch.arange(24).unsqueeze(0)
        layer_idx = hf.config.num_hidden_layers - 1  # the sliding layer of the sliding variant

        hf_layer = hf.model.layers[layer_idx]
        mask_fn = create_causal_mask
        if getattr(hf_layer.self_attn, "sliding_window", None) is not None:
            from transformers.masking_utils import create_sliding_window_causal_mask as mask_fn
        mask = mask_fn(
            config=hf.config, inputs_embeds=x_hf, attention_mask=None, cache=None, position_ids=position_ids
        )
        out_hf = hf_layer(
            x_hf,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=hf.model.rotary_emb(x_hf, position_ids),
        )
        out_xtl = model.layers[layer_idx](x_xtl, model.rotary_emb(position_ids, dtype), AttentionMaskSpec())
        assert torch.equal(out_hf, out_xtl)

        assert_head_loss_and_input_grad_equal(hf, model, out_hf, out_xtl, x_hf, x_xtl, labels)


@pytest.mark.usefixtures("hf_impl")
class TestWholeModelParity:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_logits_loss_and_embedding_grad_are_bitwise(self, tiny_hf_dir, variant, dtype):
        path = tiny_hf_dir(variant, dtype)
        hf, model = _load_pair(path, dtype)
        torch.manual_seed(2)
        seq = 40 if variant == "llama_dynamic_rope" else 24  # dynamic rope: longer than max_position_embeddings
        ids = torch.randint(0, hf.config.vocab_size, (2, seq))
        labels = ids.clone()
        labels[0, :5] = -100
        emb_hf = hf.get_input_embeddings()(ids).detach().requires_grad_()
        emb_xtl = emb_hf.detach().clone().requires_grad_()
        out_hf = hf(inputs_embeds=emb_hf, labels=labels)
        out_xtl = model(inputs_embeds=emb_xtl, labels=labels)
        assert torch.equal(out_hf.logits, out_xtl.logits)
        assert torch.equal(out_hf.loss, out_xtl.loss)
        out_hf.loss.backward()
        out_xtl.loss.backward()
        assert torch.equal(emb_hf.grad, emb_xtl.grad)

    def test_input_ids_call_with_padding_mask_matches(self, tiny_hf_dir):
        hf, model = _load_pair(tiny_hf_dir("qwen3"), torch.float32)
        ids = torch.randint(0, hf.config.vocab_size, (2, 16))
        attention_mask = torch.ones_like(ids)
        attention_mask[1, 12:] = 0
        out_hf = hf(input_ids=ids, attention_mask=attention_mask)
        out_xtl = model(input_ids=ids, attention_mask=attention_mask)
        assert torch.equal(out_hf.logits[:, :12], out_xtl.logits[:, :12])
