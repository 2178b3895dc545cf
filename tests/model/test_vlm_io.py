"""Qwen3-VL / Qwen3-VL-MoE configs and checkpoints: config round trip, registry dispatch, byte-identical save_hf."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from xtl.model import MODEL_TYPES, get_model_config_from_hf
from xtl.model.compose import Qwen3VL, Qwen3VLConfig, Qwen3VLMoeConfig, Qwen3VLMoeText, Qwen3VLText
from xtl.model.hf import CheckpointReader
from xtl.module.vision import LayerNorm

from .vlm import VARIANTS, VLM_VARIANTS, image_text_batch, save_tiny_vlm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_vlm_dir(variant, dtype) -> Path`` of a saved tiny HF VLM checkpoint."""
    root = tmp_path_factory.mktemp("hf_vlm_io")
    return lambda variant, dtype=torch.float32: save_tiny_vlm(variant, dtype, root)


def _all_tensors(path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {k: reader.load(k) for k in reader.keys()}


def _load(path) -> Qwen3VL:
    with torch.device("meta"):
        model = get_model_config_from_hf(path).build()
    model.from_hf(path)
    return model


class TestVLMConfig:
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_from_hf_then_hf_config_is_identity(self, tiny_vlm_dir, variant):
        path = tiny_vlm_dir(variant)
        reference = AutoConfig.from_pretrained(path).to_dict()
        cfg = get_model_config_from_hf(path)
        regenerated = cfg.hf_config.to_dict()
        reference.pop("_name_or_path", None)
        regenerated.pop("_name_or_path", None)
        assert regenerated == reference
        assert type(cfg).from_hf_config(cfg.hf_config) == cfg

    def test_dispatch_is_on_model_type(self, tiny_vlm_dir):
        expected = {"qwen3_vl": (Qwen3VLConfig, Qwen3VLText), "qwen3_vl_moe": (Qwen3VLMoeConfig, Qwen3VLMoeText)}
        for variant in VARIANTS:
            cfg = get_model_config_from_hf(tiny_vlm_dir(variant))
            assert type(cfg) is MODEL_TYPES[variant] is expected[variant][0]
            with torch.device("meta"):
                model = cfg.build()
            assert isinstance(model.language_model, expected[variant][1])

    def test_text_config_is_xtls_qwen3(self, tiny_vlm_dir):
        cfg = get_model_config_from_hf(tiny_vlm_dir("qwen3_vl_moe"))
        assert cfg.text_config.num_routed_experts == 4 and cfg.text_config.norm_topk_prob
        assert cfg.text_config.rope.params["mrope_section"] == [4, 2, 2]
        assert cfg.vision_config.deepstack_visual_indexes == [0, 1]
        assert not cfg.tie_word_embeddings and not cfg.text_config.tie_word_embeddings

    def test_mrope_section_must_fit_the_head(self, tiny_vlm_dir):
        cfg = get_model_config_from_hf(tiny_vlm_dir("qwen3_vl"))
        cfg.text_config.rope.params["mrope_section"] = [4, 4, 4]
        with pytest.raises(ValueError, match="must sum to head_dim // 2 = 8"), torch.device("meta"):
            cfg.build()


class TestVLMCheckpoint:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_save_hf_is_byte_identical(self, tiny_vlm_dir, tmp_path, variant, dtype):
        src = tiny_vlm_dir(variant, dtype)
        model = _load(src)
        model.save_hf(tmp_path / "export")
        before, after = _all_tensors(src), _all_tensors(tmp_path / "export")
        assert set(before) == set(after)
        for key, tensor in before.items():
            assert after[key].dtype == tensor.dtype, key
            assert torch.equal(after[key].view(torch.uint8), tensor.view(torch.uint8)), key
        assert (
            AutoConfig.from_pretrained(tmp_path / "export").to_dict()["text_config"]
            == (AutoConfig.from_pretrained(src).to_dict()["text_config"])
        )

    def test_transposed_expert_layout_loads_and_saves_as_stored(self, tiny_vlm_dir, tmp_path):
        src = tiny_vlm_dir("qwen3_vl_moe")
        tensors = _all_tensors(src)
        released = {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v) for k, v in tensors.items()}
        assert any(".experts." in k for k in released)
        out = tmp_path / "released"
        out.mkdir()
        save_file(released, str(out / "model.safetensors"))
        (out / "config.json").write_text((src / "config.json").read_text())
        reference, model = _load(src), _load(out)
        for name, p in reference.named_parameters():
            assert torch.equal(p, model.get_parameter(name)), name
        model.save_hf(tmp_path / "export")
        after = _all_tensors(tmp_path / "export")
        assert all(torch.equal(after[k], v) for k, v in released.items())

    @pytest.mark.parametrize("variant", VARIANTS)
    def test_shard_units_and_init(self, tiny_vlm_dir, variant):
        cfg = get_model_config_from_hf(tiny_vlm_dir(variant))
        with torch.device("meta"):
            model = cfg.build()
        units = model.shard_units()
        assert len(units) == 2 + 3
        assert units[:2] == list(model.visual.blocks) and units[2:] == list(model.language_model.layers)
        model.init_weights()
        assert all(
            torch.equal(m.weight, torch.ones_like(m.weight)) for m in model.modules() if isinstance(m, LayerNorm)
        )
        batch = image_text_batch()
        batch.pop("mm_token_type_ids")  # derived from the image placeholders when absent
        out = model(**batch)
        out.loss.backward()
        assert torch.isfinite(out.loss) and model.visual.patch_embed.proj.weight.grad is not None
        assert VLM_VARIANTS[variant][0].model_type == cfg.model_type
