"""Config round trips with transformers and the model registry."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig

from xtl.model import ALIASES, MODEL_TYPES, alias_names, get_model_config, get_model_config_from_hf
from xtl.module.rope import RopeConfig

from ..conftest import TINY_VARIANTS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def _comparable(config) -> dict:
    d = config.to_dict()
    d.pop("_name_or_path", None)
    d.pop("transformers_version", None)
    return d


class TestHFConfigRoundTrip:
    @pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
    def test_from_hf_then_hf_config_is_identity(self, tiny_hf_dir, variant):
        path = tiny_hf_dir(variant)
        assert _comparable(get_model_config_from_hf(path).hf_config) == _comparable(AutoConfig.from_pretrained(path))

    @pytest.mark.parametrize("alias", sorted(alias_names()))
    def test_every_size_config_round_trips(self, alias):
        cfg = get_model_config(alias)
        again = type(cfg).from_hf_config(cfg.hf_config)
        assert dataclasses.asdict(again) == dataclasses.asdict(cfg)

    def test_legacy_rope_scaling_is_read(self, tmp_path):
        raw = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4).to_dict()
        raw.pop("rope_parameters")
        raw["rope_theta"] = 500000.0
        raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        rope = get_model_config_from_hf(tmp_path).rope
        assert rope == RopeConfig(rope_type="linear", rope_theta=500000.0, params={"factor": 4.0})
        assert RopeConfig.from_hf_config(raw) == rope

    def test_optional_fields_fall_back_to_defaults(self, tmp_path):
        raw = {
            "model_type": "qwen3",
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
        (tmp_path / "config.json").write_text(json.dumps(raw))
        cfg = get_model_config_from_hf(tmp_path)
        assert cfg.num_key_value_heads == AutoConfig.from_pretrained(tmp_path).num_key_value_heads
        assert cfg.tie_word_embeddings is False
        assert cfg.rope.rope_type == "default"


class TestRegistry:
    def test_dispatch_is_on_model_type(self, tiny_hf_dir):
        for variant, (config_cls, _, _) in TINY_VARIANTS.items():
            cfg = get_model_config_from_hf(tiny_hf_dir(variant))
            assert type(cfg) is MODEL_TYPES[config_cls.model_type]

    def test_unknown_model_type_lists_supported(self, tmp_path):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama.*qwen2.*qwen3"):
            get_model_config_from_hf(tmp_path)

    def test_missing_config_is_a_clear_error(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="config.json not found"):
            get_model_config_from_hf(tmp_path)

    @pytest.mark.parametrize("spelling", ["qwen3-8b", "Qwen3_8B", "QWEN3-8b", "qwen3_8_b"])
    def test_alias_lookup_ignores_case_dash_and_underscore(self, spelling):
        assert type(get_model_config(spelling)).__name__ == "Qwen3Dense8BConfig"

    def test_unknown_alias_lists_known(self):
        with pytest.raises(KeyError, match="known aliases: .*qwen3-8b"):
            get_model_config("qwen9-1t")

    def test_published_dimensions(self):
        cfg = get_model_config("llama3.1-8b")
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.rope.rope_type) == (
            4096,
            32,
            8,
            "llama3",
        )
        assert get_model_config("qwen3-0.6b").tie_word_embeddings
        assert get_model_config("qwen2.5-7b").vocab_size == 152064
        assert len(ALIASES) >= 12


class TestConfigTraits:
    """Every family answers the traits code reads (no ``getattr`` with a default): the value of a family without the
    feature, or the field of the family that has it."""

    @pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
    def test_every_family_declares_them(self, model_type):
        config = MODEL_TYPES[model_type]()
        fields = {f.name for f in dataclasses.fields(config)}
        language = config.language_config
        assert config.mtp_layers == (config.mtp_layers if "mtp_layers" in fields else 0) == language.mtp_layers
        assert isinstance(config.router_aux_loss_coef, float)
        assert config.per_layer_fields == tuple(f for f in ("layer_types",) if f in fields)
        assert (language is config) != config.vision_language
        assert language.language_config is language and not language.vision_language

    def test_a_field_of_the_family_is_the_trait(self):
        assert MODEL_TYPES["deepseek_v3"](mtp_layers=1).mtp_layers == 1
        assert MODEL_TYPES["qwen3_moe"](router_aux_loss_coef=0.01).router_aux_loss_coef == 0.01
        assert MODEL_TYPES["qwen3"]().router_aux_loss_coef == 0.0 == MODEL_TYPES["deepseek_v3"]().router_aux_loss_coef
        vlm = MODEL_TYPES["qwen3_vl_moe"]()
        assert vlm.language_config is vlm.text_config and vlm.text_config.router_aux_loss_coef == 0.001
        assert vlm.router_aux_loss_coef == 0.0  # the balance loss of a vision-language model is routing's to set


class TestModelsDoc:
    def test_docs_list_exactly_the_registered_models(self):
        text = DOCS.read_text().split("## Released sizes", 1)[1].split("\n## ", 1)[0]
        rows = re.findall(r"^\| `([^`]+)` \| `(\w+)` \| `(\w+)` \|", text, flags=re.M)
        documented = {alias: (cls, model_type) for alias, cls, model_type in rows}
        registered = {alias: (cls.__name__, cls.hf_config_class.model_type) for alias, cls in alias_names().items()}
        assert documented == registered, "docs/models.md is out of sync with xtl.model.registry"
