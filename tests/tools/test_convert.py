"""Tests for ``xtl convert to-fp8`` and ``xtl convert repack``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.tools.ckpt_utils import tiny_moe_tensors
from xtl.model.hf import CheckpointFormatError, CheckpointReader, ShardSizeError, is_standard_layout
from xtl.tools import convert
from xtl.tools._cli import ToolInputError
from xtl.tools.fp8 import (
    FP8_DTYPE,
    convert_to_fp8,
    dequantize_blockwise,
    error_bound,
    quantize_blockwise,
    select_tensors,
)
from xtl.tools.repack import repack

# The default rule set applied by hand to tiny_moe_tensors(): projections of attention, dense/per-expert/fused/shared
# experts and MTP layers; never norms, q/k norms, biases, the router, the shared-expert gate, embeddings, the head,
# mtp.fc or the vision tower.
EXPECTED_DEFAULT = {
    f"model.layers.{i}.{n}"
    for i in range(2)
    for n in (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.experts.0.gate_proj.weight",
        "mlp.experts.0.up_proj.weight",
        "mlp.experts.0.down_proj.weight",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    )
} | {"mtp.layers.0.self_attn.q_proj.weight"}


def _split(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Spread tensors over the given shard names round-robin."""
    shards: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    for i, (k, v) in enumerate(sorted(tensors.items())):
        shards[names[i % len(names)]][k] = v
    return shards


def _load_all(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(directory / shard, framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(index["weight_map"]), "index and shard contents disagree"
    return out


class TestBlockQuantization:
    def test_dequantized_within_fp8_bound_2d(self) -> None:
        w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # columns of very different magnitude
        q, scale = quantize_blockwise(w)
        assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (3, 2) and scale.dtype == torch.float32
        err = (w - dequantize_blockwise(q, scale)).abs()
        assert bool((err <= error_bound(w, scale)).all())
        assert bool((torch.log2(scale) == torch.round(torch.log2(scale))).all()), "ue8m0 scales are powers of two"

    def test_3d_experts_are_quantized_one_by_one(self) -> None:
        w = torch.randn(3, 130, 260)
        w[1] *= 1000  # a loud expert must not change the scales of the others
        q, scale = quantize_blockwise(w)
        assert scale.shape == (3, 2, 3)
        for e in range(3):
            q_e, s_e = quantize_blockwise(w[e])
            assert torch.equal(s_e, scale[e]) and torch.equal(q_e.float(), q[e].float())
        assert bool(((w - dequantize_blockwise(q, scale)).abs() <= error_bound(w, scale)).all())

    def test_zero_block_and_saturation_edge(self) -> None:
        w = torch.zeros(128, 256)
        w[0, 200] = 448.0 * 4  # exactly at the top of the fp8 range after scaling
        q, scale = quantize_blockwise(w)
        assert scale[0, 0] == 1.0 and scale[0, 1] == 4.0
        assert torch.equal(dequantize_blockwise(q, scale), w)


class TestSelection:
    def test_default_rules_choose_exactly_the_projection_weights(self, make_ckpt) -> None:
        src = make_ckpt("src", {"model.safetensors": tiny_moe_tensors()})
        assert select_tensors(CheckpointReader(src)) == EXPECTED_DEFAULT

    def test_reference_set_is_replicated_literally(self, make_ckpt) -> None:
        tensors = tiny_moe_tensors()
        chosen = {"model.layers.0.self_attn.o_proj.weight", "lm_head.weight", "model.layers.1.mlp.experts.down_proj"}
        ref_tensors = {k: v for k, v in tensors.items() if k not in chosen}
        for name in chosen:
            ref_tensors[name] = tensors[name].to(FP8_DTYPE)
            ref_tensors[name + "_scale_inv"] = torch.ones(2, 2)
        src = make_ckpt("src", {"model.safetensors": tensors})
        ref = make_ckpt("ref", _split(ref_tensors, ["a.safetensors", "b.safetensors"]))
        assert select_tensors(CheckpointReader(src), ref) == chosen

    def test_reference_naming_a_missing_tensor_is_an_input_error(self, make_ckpt) -> None:
        src = make_ckpt("src", {"model.safetensors": tiny_moe_tensors()})
        ref = make_ckpt(
            "ref", {"model.safetensors": {"model.layers.9.self_attn.q_proj.weight_scale_inv": torch.ones(1)}}
        )
        with pytest.raises(ToolInputError, match="absent from the source"):
            select_tensors(CheckpointReader(src), ref)


class TestToFp8:
    def test_output_loads_index_complete_and_round_trip_bounded(self, make_ckpt, tmp_path: Path) -> None:
        tensors = tiny_moe_tensors()
        src = make_ckpt(
            "src", _split(tensors, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
        )
        report = convert_to_fp8(src, tmp_path / "out")
        out = _load_all(tmp_path / "out")
        assert not report.repacked and sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]
        assert set(report.quantized) == EXPECTED_DEFAULT and not report.bound_violations
        assert set(out) == set(tensors) | {n + "_scale_inv" for n in EXPECTED_DEFAULT}
        for name, original in tensors.items():
            if name in EXPECTED_DEFAULT:
                assert out[name].dtype == FP8_DTYPE and out[name + "_scale_inv"].dtype == torch.float32
                deq = dequantize_blockwise(out[name], out[name + "_scale_inv"])
                assert bool(((original.float() - deq).abs() <= error_bound(original, out[name + "_scale_inv"])).all())
            else:
                assert torch.equal(out[name], original), f"{name} must be kept unchanged"
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
        for name in EXPECTED_DEFAULT:  # weight and scale share a shard
            assert index["weight_map"][name] == index["weight_map"][name + "_scale_inv"]

    def test_quantization_config_written(self, make_ckpt, tmp_path: Path) -> None:
        src = make_ckpt("src", {"model.safetensors": tiny_moe_tensors()}, config={"model_type": "qwen3_moe", "x": 1})
        (src / "tokenizer.json").write_text("{}")
        convert_to_fp8(src, tmp_path / "out")
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        qc = config["quantization_config"]
        assert config["x"] == 1 and (tmp_path / "out" / "tokenizer.json").is_file()
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["scale_fmt"] == "ue8m0"
        assert "lm_head" in qc["modules_to_not_convert"] and "model.layers.0.mlp.gate" in qc["modules_to_not_convert"]
        assert not {n.removesuffix(".weight") for n in EXPECTED_DEFAULT} & set(qc["modules_to_not_convert"])

    def test_non_standard_names_are_repacked(self, make_ckpt, tmp_path: Path) -> None:
        names = [
            "model-language-0001-fused-save_rank0.safetensors",
            "model-language-0002-fused-save_rank1.safetensors",
        ]
        src = make_ckpt("src", _split(tiny_moe_tensors(), names))
        report = convert_to_fp8(src, tmp_path / "out", max_shard_size="150KiB")
        shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
        assert report.repacked and len(shards) > 2 and is_standard_layout(shards)
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert all(index["weight_map"][n] == index["weight_map"][n + "_scale_inv"] for n in EXPECTED_DEFAULT)
        assert not list(tmp_path.glob(".*")), "no staging directories left behind"

    def test_no_repack_keeps_source_names(self, make_ckpt, tmp_path: Path) -> None:
        src = make_ckpt("src", {"engine_rank0.safetensors": tiny_moe_tensors()})
        report = convert_to_fp8(src, tmp_path / "out", repack=False)
        assert not report.repacked and (tmp_path / "out" / "engine_rank0.safetensors").is_file()

    def test_cli_dry_run_and_exit_codes(self, make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        src = make_ckpt("src", {"model.safetensors": tiny_moe_tensors()})
        out = tmp_path / "out"
        assert convert.main(["to-fp8", "--source", str(src), "--output", str(out), "--dry-run"]) == 0
        assert f"{len(EXPECTED_DEFAULT)} of" in capsys.readouterr().out and not out.exists()
        assert convert.main(["to-fp8", "--source", str(src), "--output", str(out)]) == 0
        assert "bound violations: 0" in capsys.readouterr().out
        assert convert.main(["to-fp8", "--source", str(tmp_path / "nope"), "--output", str(out)]) == 2
        (src / "config.json").unlink()
        assert convert.main(["to-fp8", "--source", str(src), "--output", str(tmp_path / "o2")]) == 2
        assert "config.json" in capsys.readouterr().err


class TestRepack:
    def test_tensors_byte_identical_across_several_shards(self, make_ckpt, tmp_path: Path) -> None:
        tensors = tiny_moe_tensors() | {"x.int": torch.arange(10, dtype=torch.int64), "x.f32": torch.randn(7)}
        src = make_ckpt("src", _split(tensors, ["rank0.safetensors", "rank1.safetensors", "rank2.safetensors"]))
        (src / "sub").mkdir()
        (src / "sub" / "notes.txt").write_text("hi")
        weight_map = repack(src, tmp_path / "out", max_shard_size="100KiB")
        out = _load_all(tmp_path / "out")
        shards = sorted(set(weight_map.values()))
        assert len(shards) >= 3 and is_standard_layout(shards)
        assert set(out) == set(tensors)
        for name, t in tensors.items():
            assert out[name].dtype == t.dtype and out[name].shape == t.shape
            assert out[name].view(torch.uint8).equal(t.contiguous().view(torch.uint8)), name
        for shard in shards:  # no shard over the limit unless it holds a single oversized tensor
            size = (tmp_path / "out" / shard).stat().st_size
            assert size <= 100 * 1024 + 4096 or sum(1 for s in weight_map.values() if s == shard) == 1
        assert (tmp_path / "out" / "sub" / "notes.txt").read_text() == "hi"
        assert (tmp_path / "out" / "config.json").is_file()

    def test_missing_shard_and_mismatched_index_are_input_errors(self, make_ckpt, tmp_path: Path) -> None:
        src = make_ckpt("src", {"a.safetensors": {"w": torch.ones(2)}, "b.safetensors": {"v": torch.ones(2)}})
        (src / "b.safetensors").unlink()
        with pytest.raises(FileNotFoundError, match="does not exist"):
            repack(src, tmp_path / "out")
        index = {"weight_map": {"w": "a.safetensors", "ghost": "a.safetensors"}}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointFormatError, match="not found in a.safetensors"):
            repack(src, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        argv = ["repack", "--source", str(src), "--output", str(tmp_path / "out")]
        assert convert.main(argv) == 2

    def test_unindexed_multi_file_dir_is_rejected(self, make_ckpt, tmp_path: Path) -> None:
        src = make_ckpt(
            "src", {"a.safetensors": {"w": torch.ones(2)}, "b.safetensors": {"v": torch.ones(2)}}, index=False
        )
        with pytest.raises(CheckpointFormatError, match="no model.safetensors.index.json"):
            CheckpointReader(src)

    def test_api_rejects_a_bare_size(self, make_ckpt, tmp_path: Path) -> None:
        src = make_ckpt("src", {"weird.safetensors": {"w": torch.ones(3)}})
        with pytest.raises(ShardSizeError, match="has no unit"):
            repack(src, tmp_path / "out", max_shard_size="4")
        assert not (tmp_path / "out").exists()

    def test_cli_bare_max_shard_size_asks_for_a_unit(
        self, make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture
    ) -> None:
        src = make_ckpt("src", {"weird.safetensors": {"w": torch.ones(3)}})
        for option in ("--max-shard-size", "--shard-size"):
            argv = ["repack", "--source", str(src), "--output", str(tmp_path / "o"), option, "5"]
            assert convert.main(argv) == 2
            assert "max shard size '5' has no unit; write e.g. 5GB or 4GiB" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()

    def test_cli(self, make_ckpt, tmp_path: Path) -> None:
        src = make_ckpt("src", {"weird.safetensors": {"w": torch.ones(3)}})
        assert convert.main(["repack", "--source", str(src), "--output", str(tmp_path / "o")]) == 0
        assert (tmp_path / "o" / "model-00001-of-00001.safetensors").is_file()
        argv = ["repack", "--source", str(src), "--output", str(tmp_path / "o2"), "--max-shard-size", "1KiB"]
        assert convert.main(argv) == 0 and (tmp_path / "o2" / "model-00001-of-00001.safetensors").is_file()
        assert (
            convert.main(["repack", "--source", str(src), "--output", str(tmp_path / "o"), "--max-shard-size", "x"])
            == 2
        )
        assert convert.main(["repack", "--help"]) == 0
        assert convert.main(["frobnicate"]) == 2
