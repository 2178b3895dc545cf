"""Block-quantized fp8 checkpoints (DeepSeek-V3 layout, made here with ``xtl convert to-fp8`` from a tiny random
``DeepseekV3Config`` checkpoint): ``from_hf`` dequantizes them, a model trains a step and ``save_hf(fp8="blockwise")``
writes the format back, byte-identical to ``to-fp8``; transformers loads both, ``xtl check-hf-config`` accepts them.

Tolerances: loading is exact (a dequantized weight is ``fp8.float() * scale_inv``, exactly representable in float32
and bfloat16 because the scales are powers of two), so xtl's and transformers' (CPU: dequantized to bf16) logits
are compared bitwise under ``XTL_HF_IMPL=1``. Re-quantizing after a step obeys ``xtl.tools.fp8.error_bound``.
"""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xtl.callbacks import HFExport
from xtl.command import main
from xtl.model import get_model_config_from_hf
from xtl.model.hf import SCALE_SUFFIX, CheckpointFormatError, CheckpointReader, dequantize_blockwise
from xtl.model.moe import MoE
from xtl.tools.fp8 import error_bound

from .test_moe_parity import load_pair, save_tiny_moe


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``bf16``: a tiny DeepSeek-V3 checkpoint; ``fp8``: ``xtl convert to-fp8`` of it (repacked: standard shards)."""
    root = tmp_path_factory.mktemp("hf_fp8")
    bf16 = save_tiny_moe("deepseek_v3", torch.bfloat16, root)
    assert main(["convert", "to-fp8", "--source", str(bf16), "--output", str(root / "fp8"), "--repack"]) == 0
    return {"bf16": bf16, "fp8": root / "fp8"}


def _load(path: Path) -> MoE:
    with torch.device("meta"):
        model = get_model_config_from_hf(path).build()
    model.from_hf(path)
    return model


def _dequantized(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint but the scales, quantized ones dequantized (float32)."""
    reader = CheckpointReader(path)
    out = {}
    for key in reader.weight_map:
        if key.endswith(SCALE_SUFFIX):
            continue
        tensor = reader.load(key)
        scale = key + SCALE_SUFFIX
        out[key] = dequantize_blockwise(tensor, reader.load(scale)) if scale in reader else tensor.float()
    return out


class TestLoad:
    def test_the_checkpoint_is_block_fp8(self, ckpts):
        reader = CheckpointReader(ckpts["fp8"])
        assert reader.info("model.layers.1.mlp.experts.3.down_proj.weight")[0] == "F8_E4M3"
        assert reader.info("model.layers.0.self_attn.q_a_proj.weight" + SCALE_SUFFIX) == ("F32", (1, 1))
        config = json.loads((ckpts["fp8"] / "config.json").read_text())
        assert config["quantization_config"]["weight_block_size"] == [128, 128]

    def test_from_hf_dequantizes_every_fp8_weight(self, ckpts):
        model = _load(ckpts["fp8"])
        expected = _dequantized(ckpts["fp8"])
        for name, param in model.checkpoint_tensors().items():
            for key, part in zip(model.hf_keys(name), model.param_to_hf(name, param.detach())):
                assert torch.equal(part.float(), expected[key]), key

    @pytest.mark.usefixtures("hf_impl")
    def test_logits_equal_transformers_dequantized_load(self, ckpts):
        hf, model = load_pair(ckpts["fp8"], torch.bfloat16)
        ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(hf(input_ids=ids).logits, model(input_ids=ids).logits)

    def test_fp8_tensors_without_a_quantization_config_are_rejected(self, ckpts, tmp_path):
        path = shutil.copytree(ckpts["fp8"], tmp_path / "no_config")
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointFormatError, match="declares no quantization_config"):
            _load(path)

    def test_per_tensor_fp8_is_rejected(self, ckpts, tmp_path):
        path = shutil.copytree(ckpts["fp8"], tmp_path / "per_tensor")
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]["weight_block_size"]
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointFormatError, match="weight_block_size"):
            _load(path)


class TestSave:
    def test_save_hf_fp8_is_byte_identical_to_convert_to_fp8(self, ckpts, tmp_path):
        _load(ckpts["bf16"]).save_hf(tmp_path / "xtl", fp8="blockwise")
        files = sorted(p.name for p in (tmp_path / "xtl").iterdir())
        assert files == sorted(p.name for p in ckpts["fp8"].iterdir())
        for name in files:
            assert filecmp.cmp(tmp_path / "xtl" / name, ckpts["fp8"] / name, shallow=False), name

    def test_hf_export_writes_the_same_fp8_checkpoint(self, ckpts, tmp_path):
        trainer = SimpleNamespace(
            default_root_dir=str(tmp_path),
            is_global_zero=True,
            strategy=SimpleNamespace(),
            datamodule=None,
            callbacks=[],
        )
        trainer.strategy.barrier = lambda: None
        target = HFExport(fp8="blockwise").export(trainer, SimpleNamespace(model=_load(ckpts["bf16"])), "final")
        shard = "model-00001-of-00001.safetensors"
        assert filecmp.cmp(target / shard, ckpts["fp8"] / shard, shallow=False)

    def test_fp8_load_then_fp8_save_keeps_every_value(self, ckpts, tmp_path):
        _load(ckpts["fp8"]).save_hf(tmp_path / "again", fp8="blockwise")
        again, source = _dequantized(tmp_path / "again"), _dequantized(ckpts["fp8"])
        assert again.keys() == source.keys()
        assert all(torch.equal(again[key], source[key]) for key in source)

    def test_without_fp8_the_export_is_high_precision(self, ckpts, tmp_path):
        _load(ckpts["fp8"]).save_hf(tmp_path / "bf16")
        reader = CheckpointReader(tmp_path / "bf16")
        assert not any(key.endswith(SCALE_SUFFIX) for key in reader.weight_map)
        assert "quantization_config" not in json.loads((tmp_path / "bf16/config.json").read_text())

    def test_unknown_fp8_format_names_the_key(self, ckpts, tmp_path):
        with pytest.raises(ValueError, match="fp8"):
            _load(ckpts["bf16"]).save_hf(tmp_path / "x", fp8="tensorwise")
        with pytest.raises(ValueError, match="fp8"):
            HFExport(fp8="mxfp8")


class TestTrainAndExport:
    @pytest.mark.usefixtures("hf_impl")
    def test_a_step_then_an_fp8_export_loads_in_transformers(self, ckpts, tmp_path):
        model = _load(ckpts["fp8"]).train()
        ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
        model.save_hf(tmp_path / "out", fp8="blockwise")

        trained = {k: t for name, p in model.checkpoint_tensors().items() for k, t in _hf_parts(model, name, p)}
        exported = _dequantized(tmp_path / "out")
        reader = CheckpointReader(tmp_path / "out")
        key = "model.layers.1.mlp.experts.0.gate_proj.weight"
        assert not torch.equal(exported[key], _dequantized(ckpts["fp8"])[key]), "the step changed the weights"
        weight = trained[key].to(torch.bfloat16)
        bound = error_bound(weight, reader.load(key + SCALE_SUFFIX))
        assert bool(((weight.float() - exported[key]).abs() <= bound).all())

        hf, reloaded = load_pair(tmp_path / "out", torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(hf(input_ids=ids).logits, reloaded(input_ids=ids).logits)


class TestCheckHFConfig:
    def test_accepts_converted_and_exported_fp8_checkpoints(self, ckpts, tmp_path, capsys):
        _load(ckpts["bf16"]).save_hf(tmp_path / "xtl", fp8="blockwise")
        assert main(["check-hf-config", str(ckpts["fp8"])]) == 0
        assert main(["check-hf-config", str(tmp_path / "xtl")]) == 0
        assert "OK" in capsys.readouterr().out

    def test_reports_a_quantization_config_xtl_would_not_write(self, ckpts, tmp_path, capsys):
        path = shutil.copytree(ckpts["fp8"], tmp_path / "other")
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"]["scale_fmt"] = "float"
        (path / "config.json").write_text(json.dumps(config))
        assert main(["check-hf-config", str(path)]) == 1
        assert "/quantization_config/scale_fmt" in capsys.readouterr().out


def _hf_parts(model: MoE, name: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return list(zip(model.hf_keys(name), model.param_to_hf(name, param.detach())))
