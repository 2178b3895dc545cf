"""VisionLM: part mapping, freezing, per-part learning rates, a training step on a pack with images, HF export."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from xtl.batch import SequenceContext
from xtl.errors import ConfigError
from xtl.model import get_model_config_from_hf
from xtl.train import VisionLM, VisionMoELM
from xtl.train.vision_lm import part_of

PATCH_DIM = 3 * 2 * 8 * 8
TINY_VL = {
    "model_type": "qwen3_vl",
    "image_token_id": 60,
    "vision_start_token_id": 61,
    "vision_end_token_id": 62,
    "video_token_id": 63,
    "text_config": {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "params": {"mrope_section": [4, 2, 2]}},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 32,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    },
}
TINY_VL_MOE = {
    **TINY_VL,
    "model_type": "qwen3_vl_moe",
    "text_config": {**TINY_VL["text_config"], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
}


def _module(cls=VisionLM, spec=TINY_VL, **kwargs) -> VisionLM:
    module = cls(spec, **kwargs)
    module.configure_model()
    return module


def _pack() -> tuple[SequenceContext, torch.Tensor]:
    """Two documents: one with a 4x4-patch image (4 tokens), one text only."""
    g = torch.Generator().manual_seed(0)
    doc1 = [5, 61, *[60] * 4, 62, 7, 8, 9]
    doc2 = [10, 11, 12, 13]
    ids = torch.tensor([doc1 + doc2])
    ctx = SequenceContext.from_lengths(ids, [len(doc1), len(doc2)])
    ctx.extras = {"pixel_values": torch.randn(16, PATCH_DIM, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    labels = torch.randint(0, 60, ids.shape, generator=g)
    return ctx, labels


class TestParts:
    @pytest.mark.parametrize(
        ("name", "part"),
        [
            ("visual.blocks.0.attn.qkv.weight", "vision"),
            ("visual.patch_embed.proj.weight", "vision"),
            ("visual.pos_embed.weight", "vision"),
            ("visual.merger.linear_fc1.weight", "merger"),
            ("visual.deepstack_merger_list.0.norm.weight", "merger"),
            ("language_model.layers.0.mlp.down_proj.weight", "language"),
            ("language_model.embed_tokens.weight", "language"),
            ("visual.blocks.1._checkpoint_wrapped_module.mlp.linear_fc1.weight", "vision"),
        ],
    )
    def test_part_of(self, name, part):
        assert part_of(name) == part

    def test_every_parameter_has_a_part(self):
        module = _module()
        parts = {part_of(n) for n, _ in module.model.named_parameters()}
        assert parts == {"vision", "merger", "language"}


class TestFreezeAndLearningRates:
    @pytest.mark.parametrize("frozen", ["vision", "merger", "language"])
    def test_freeze_one_part(self, frozen):
        module = _module(**{f"freeze_{frozen}": True})
        for name, param in module.model.named_parameters():
            assert param.requires_grad == (part_of(name) != frozen), name
        counts = module.trainable_parameters()
        assert counts[frozen] == 0 and all(v > 0 for k, v in counts.items() if k != frozen)

    def test_frozen_parameters_do_not_change_in_a_step(self):
        module = _module(freeze_vision=True, language_lr_scale=0.5, merger_lr_scale=2.0)
        optimizer = module.configure_optimizers()["optimizer"]
        before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        ctx, labels = _pack()
        module.model(seq_ctx=ctx, labels=labels).loss.backward()
        optimizer.step()
        for name, param in module.model.named_parameters():
            changed = not torch.equal(before[name], param)
            assert changed == (part_of(name) != "vision"), name

    def test_learning_rate_per_part(self):
        module = _module(vision_lr_scale=0.1, merger_lr_scale=2.0)
        optimizer = module.configure_optimizers()["optimizer"]
        base = module.optimizer_config.lr
        lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
        assert lrs == pytest.approx({"vision": 0.1 * base, "merger": 2.0 * base, "language": base})
        grouped = sum(len(g["params"]) for g in optimizer.param_groups)
        assert grouped == sum(1 for p in module.model.parameters() if p.requires_grad)
        decays = {(g["name"], g["weight_decay"]) for g in optimizer.param_groups}
        assert ("language", 0.0) in decays and ("language", module.optimizer_config.weight_decay) in decays

    def test_bad_options(self):
        with pytest.raises(ConfigError, match="nothing to train"):
            VisionLM(TINY_VL, freeze_vision=True, freeze_merger=True, freeze_language=True)
        with pytest.raises(ConfigError, match="vision_lr_scale"):
            VisionLM(TINY_VL, vision_lr_scale=0.0)
        text_only = {"model_type": "qwen3", **TINY_VL["text_config"]}
        text_only.pop("rope")
        with pytest.raises(ConfigError, match=r"VisionLM does not train qwen3 \(a dense model\); use .*CausalLM"):
            VisionLM(text_only)


class TestMoE:
    def test_router_losses_come_from_moecausallm(self):
        module = _module(VisionMoELM, TINY_VL_MOE, balance_loss_coef=0.01)
        ctx, labels = _pack()
        out = module.model(seq_ctx=ctx, labels=labels)
        module._num_micro_batches = 1
        module._router_log = {"balance_loss": 0.0, "z_loss": 0.0}
        module._dp_world_size = lambda: 1
        extra = module.extra_loss(out, torch.tensor(10))
        assert extra is not None and extra > 0
        assert module._router_log["balance_loss"] > 0

    def test_bias_update_is_refused(self):
        with pytest.raises(ConfigError, match="router_bias_update_lr"):
            VisionMoELM(TINY_VL_MOE, router_bias_update_lr=1e-3)


class TestExport:
    def test_save_hf_loads_in_transformers_with_equal_logits(self, tmp_path):
        module = _module()
        module.model.save_hf(tmp_path / "hf")
        hf = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
        ctx, _ = _pack()
        ids = ctx.input_ids[:, :10]
        with torch.no_grad():
            ours = module.model(input_ids=ids, **ctx.extras).logits
            theirs = hf(input_ids=ids, mm_token_type_ids=(ids == 60).int(), **ctx.extras).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        assert get_model_config_from_hf(tmp_path / "hf").vision_config.patch_size == 8
