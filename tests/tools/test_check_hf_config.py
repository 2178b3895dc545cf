"""Tests for ``xtl check-hf-config``: the JSON comparison engine, engine contracts and every registered family."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import PretrainedConfig

from xtl.tools import check_hf_config
from xtl.tools.check_hf_config import (
    HFConfigFieldDependency,
    check_hf_config_save,
    compare_configs,
    diff_json,
    resolve_pointer,
    transformers_reference,
)

_TINY = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def _tiny(cls_name: str, arch: str, **extra: object) -> Callable[[], PretrainedConfig]:
    def build() -> PretrainedConfig:
        import transformers

        return getattr(transformers, cls_name)(**_TINY, architectures=[arch], **extra)

    return build


def _tiny_vlm(cls_name: str, arch: str, **text: object) -> Callable[[], PretrainedConfig]:
    def build() -> PretrainedConfig:
        import transformers

        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        text_config = {**_TINY, "intermediate_size": 96, "head_dim": 16, "rope_parameters": rope, **text}
        vision_config = {"depth": 2, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64}
        return getattr(transformers, cls_name)(
            text_config=text_config, vision_config=vision_config, architectures=[arch]
        )

    return build


# One tiny config per model type xtl registers (or will register); real checkpoints carry `architectures`.
TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _tiny("LlamaConfig", "LlamaForCausalLM", intermediate_size=96, num_key_value_heads=2),
    "qwen2": _tiny("Qwen2Config", "Qwen2ForCausalLM", intermediate_size=96, num_key_value_heads=2),
    "qwen3": _tiny("Qwen3Config", "Qwen3ForCausalLM", intermediate_size=96, num_key_value_heads=2, head_dim=16),
    "qwen3_moe": _tiny(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_key_value_heads=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    ),
    "deepseek_v3": _tiny(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
    ),
    "gpt_oss": _tiny(
        "GptOssConfig", "GptOssForCausalLM", num_key_value_heads=2, head_dim=16, intermediate_size=64,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    "qwen3_vl": _tiny_vlm("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": _tiny_vlm(
        "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2,
    ),
}  # fmt: skip


def _registered_model_types() -> list[str]:
    import xtl.model

    return sorted(xtl.model.MODEL_TYPES)


class TestDiffEngine:
    REFERENCE = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "a/b": 1},
        "layer_types": ["full_attention", "sliding_attention"],
        "tie_word_embeddings": False,
    }

    def test_identical_dicts_have_no_differences(self) -> None:
        assert diff_json(self.REFERENCE, json.loads(json.dumps(self.REFERENCE))) == []
        assert compare_configs(self.REFERENCE, dict(self.REFERENCE)).ok

    def test_dropped_field_is_reported_with_its_json_path(self) -> None:
        broken = json.loads(json.dumps(self.REFERENCE))
        del broken["rope_parameters"]["factor"]
        report = compare_configs(self.REFERENCE, broken)
        assert not report.ok
        assert [(d.path, d.kind, d.expected) for d in report.differences] == [
            ("/rope_parameters/factor", "missing", 4.0)
        ]
        assert "missing /rope_parameters/factor" in report.render()

    def test_changed_extra_list_and_escaping(self) -> None:
        other = json.loads(json.dumps(self.REFERENCE))
        other["layer_types"][1] = "full_attention"
        other["rope_parameters"]["a/b"] = 2
        other["tie_word_embeddings"] = 0  # false vs 0 is a type change
        other["new_field"] = None
        diffs = {(d.path, d.kind) for d in diff_json(self.REFERENCE, other)}
        assert diffs == {
            ("/layer_types/1", "changed"),
            ("/rope_parameters/a~1b", "changed"),
            ("/tie_word_embeddings", "changed"),
            ("/new_field", "extra"),
        }
        assert resolve_pointer(other, "/rope_parameters/a~1b") == 2
        assert diff_json({"x": [1, 2]}, {"x": [1]})[0].path == "/x"

    def test_allowances_need_reasons_and_go_stale(self) -> None:
        other = dict(self.REFERENCE, hidden_size=65)
        report = compare_configs(self.REFERENCE, other, {"/hidden_size": "intentional", "/gone": "was needed once"})
        assert report.differences == [] and report.allowed[0][0].path == "/hidden_size"
        assert report.unused_allowances == ["/gone"] and not report.ok
        with pytest.raises(ValueError, match="reason"):
            compare_configs(self.REFERENCE, other, {"/hidden_size": " "})

    def test_engine_dependencies(self) -> None:
        dep = HFConfigFieldDependency(
            engine="vllm", version="0.10.1", path="/rope_parameters/rope_type", expected="yarn",
            reason="selects the YaRN rotary embedding", source="https://github.com/vllm-project/vllm/blob/v0.10.1/x",
        )  # fmt: skip
        ok = compare_configs(self.REFERENCE, self.REFERENCE, engine_dependencies=(dep,))
        assert ok.ok and ok.checked_engine_versions == ("vllm==0.10.1",)
        exported = {k: v for k, v in self.REFERENCE.items() if k != "rope_parameters"}
        bad = compare_configs(exported, exported, engine_dependencies=(dep,))  # HF-equivalent yet engine-breaking
        assert not bad.ok and "absent" in bad.engine_failures[0]
        flag = HFConfigFieldDependency("sglang", "0.5.0", "/tie_word_embeddings", 0, "int expected")
        assert not compare_configs(self.REFERENCE, self.REFERENCE, engine_dependencies=(flag,)).ok  # False != 0
        with pytest.raises(ValueError, match="exact version"):
            compare_configs({}, {}, engine_dependencies=(HFConfigFieldDependency("vllm", "latest", "/a", 1, "r"),))


class TestTransformersReference:
    def test_reference_is_the_transformers_round_trip_not_the_raw_file(self, tmp_path: Path) -> None:
        TINY_CONFIGS["qwen3"]().save_pretrained(tmp_path)
        raw = json.loads((tmp_path / "config.json").read_text())
        del raw["head_dim"]  # an older checkpoint without the field
        (tmp_path / "config.json").write_text(json.dumps(raw))
        assert transformers_reference(tmp_path)["head_dim"] == 128  # transformers writes Qwen3Config's default


class TestRegisteredFamilies:
    def test_every_registered_family_round_trips(self, tmp_path: Path) -> None:
        types = _registered_model_types()
        assert types, "xtl.model.MODEL_TYPES is empty"
        missing = [t for t in types if t not in TINY_CONFIGS]
        assert not missing, f"add a tiny config for the newly registered families {missing} to TINY_CONFIGS"
        for model_type in types:
            src = tmp_path / model_type
            TINY_CONFIGS[model_type]().save_pretrained(src)
            report = check_hf_config_save(src)
            assert report.ok and report.transformers_version

    def test_broken_export_is_caught(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import xtl.model as model

        model_type = _registered_model_types()[0]
        TINY_CONFIGS[model_type]().save_pretrained(tmp_path)
        good = model.get_model_config_from_hf(tmp_path).hf_config

        class DroppingExport:  # the real export with one field dropped, as a buggy hf_config would write it
            def save_pretrained(self, directory: str) -> None:
                good.save_pretrained(directory)
                path = Path(directory) / "config.json"
                path.write_text(
                    json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "rms_norm_eps"})
                )

        class BrokenConfig:
            hf_config = DroppingExport()

        assert check_hf_config_save(tmp_path).ok  # the real export passes ...
        with pytest.raises(AssertionError, match="missing /rms_norm_eps"):  # ... the broken one is caught
            check_hf_config_save(tmp_path, BrokenConfig())


class TestCheckHfConfigCli:
    def test_exit_codes(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        assert check_hf_config.main(["--help"]) == 0
        assert check_hf_config.main([str(tmp_path / "nope")]) == 2
        assert check_hf_config.main([]) == 2
        TINY_CONFIGS["llama"]().save_pretrained(tmp_path / "llama")
        assert check_hf_config.main([str(tmp_path / "llama")]) == 0
        assert "OK" in capsys.readouterr().out
        # an allowance that matches no difference is a note; it fails only with --strict (CI)
        assert check_hf_config.main([str(tmp_path / "llama"), "--allow", "/x=reason", "--format", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["unused_allowances"] == ["/x"]
        assert check_hf_config.main([str(tmp_path / "llama"), "--allow", "/x=reason", "--strict"]) == 1
        assert "stale allowance /x" in capsys.readouterr().out
        assert check_hf_config.main([str(tmp_path / "llama"), "--allow", "noslash"]) == 2
        import transformers

        transformers.MambaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1).save_pretrained(tmp_path / "mamba")
        assert check_hf_config.main([str(tmp_path / "mamba")]) == 2  # a model type xtl does not support
        assert "not supported" in capsys.readouterr().err
