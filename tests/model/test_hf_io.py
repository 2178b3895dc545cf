"""HF checkpoint I/O: lazy loading, strict errors, save_hf round trip, atomic writes."""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from xtl.model import CheckpointMismatchError, get_model_config_from_hf
from xtl.model.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    CheckpointFormatError,
    CheckpointReader,
    ShardSizeError,
    ShardWriter,
    parse_size,
)

from .test_fused_projections import load_fused
from .test_moe_parity import MOE_VARIANTS, save_tiny_moe
from .vlm import VLM_VARIANTS, save_tiny_vlm


def _load(path, device_meta=True):
    cfg = get_model_config_from_hf(path)
    if device_meta:
        with torch.device("meta"):
            model = cfg.build()
    else:
        model = cfg.build()
    model.from_hf(path)
    return model.eval()


def _all_tensors(path):
    reader = CheckpointReader(path)
    return {k: reader.load(k) for k in reader.keys()}


def assert_same_tensors(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """The same keys, each in the same dtype with the same bytes."""
    assert set(after) == set(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype, key
        assert torch.equal(after[key].view(torch.uint8), tensor.view(torch.uint8)), key


def _recast(src: Path, out: Path, to_bf16: Callable[[str], bool]) -> Path:
    """A copy of the checkpoint ``src`` (config included) whose keys ``to_bf16`` selects are stored in bf16."""
    tensors = {k: v.to(torch.bfloat16) if to_bf16(k) else v for k, v in _all_tensors(src).items()}
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")
    return out


class TestSaveHFRoundTrip:
    @pytest.mark.parametrize("variant", ["llama", "qwen2_tied", "qwen3", "qwen3_tied", "llama_llama3_rope"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_keys_bytes_config_and_transformers_load(self, tiny_hf_dir, tmp_path, variant, dtype):
        src = tiny_hf_dir(variant, dtype)
        model = _load(src)
        out = tmp_path / "export"
        model.save_hf(out)

        before, after = _all_tensors(src), _all_tensors(out)
        assert set(before) == set(after)
        for key, tensor in before.items():
            assert after[key].dtype == tensor.dtype
            assert torch.equal(after[key].view(torch.uint8), tensor.view(torch.uint8)), key

        expected = tmp_path / "transformers_config"
        AutoConfig.from_pretrained(src).save_pretrained(expected)
        assert json.loads((out / "config.json").read_text()) == json.loads((expected / "config.json").read_text())

        reference = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
        reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        ids = torch.randint(0, reference.config.vocab_size, (2, 12))
        with torch.no_grad():
            assert torch.equal(reference(input_ids=ids).logits, reloaded(input_ids=ids).logits)

    def test_index_and_sharding(self, tiny_hf_dir, tmp_path):
        model = _load(tiny_hf_dir("qwen3"))
        out = tmp_path / "sharded"
        model.save_hf(out, max_shard_size="40KB")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        total = sum(t.numel() * t.element_size() for t in _all_tensors(out).values())
        assert index["metadata"]["total_size"] == total
        assert not [p for p in out.iterdir() if p.name.startswith(".")]
        reloaded = _load(out)
        ids = torch.randint(0, 100, (1, 9))
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)

    def test_side_files_are_copied(self, tiny_hf_dir, tmp_path):
        src = tmp_path / "src"
        shutil.copytree(tiny_hf_dir("qwen3"), src)
        (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')
        model = _load(src)
        model.save_hf(tmp_path / "out")
        assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
        assert (tmp_path / "out" / "generation_config.json").is_file()

    def test_failed_save_leaves_previous_export_intact(self, tiny_hf_dir, tmp_path, monkeypatch):
        model = _load(tiny_hf_dir("qwen3"))
        out = tmp_path / "export"
        model.save_hf(out)
        snapshot = sorted(p.name for p in out.iterdir())

        def boom(self, key, tensor):
            raise RuntimeError("disk full")

        monkeypatch.setattr(ShardWriter, "add", boom)
        with pytest.raises(RuntimeError, match="disk full"):
            model.save_hf(out)
        assert sorted(p.name for p in out.iterdir()) == snapshot
        assert [p.name for p in tmp_path.iterdir()] == ["export"]


class TestStoredDtypes:
    """Each tensor is saved in the dtype its checkpoint stored it in, whatever the family keeps fp32 in training."""

    VARIANTS = ["llama", "qwen2_tied", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe"]

    @pytest.fixture(scope="class")
    def checkpoint(self, tmp_path_factory, tiny_hf_dir):
        root = tmp_path_factory.mktemp("stored_dtypes")

        def make(variant: str):
            if variant in MOE_VARIANTS:
                return save_tiny_moe(variant, torch.float32, root)
            if variant in VLM_VARIANTS:
                return save_tiny_vlm(variant, torch.float32, root)
            return tiny_hf_dir(variant)

        return make

    @pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_mixed_dtype_checkpoint_round_trips_byte_identical(self, checkpoint, tmp_path, variant, fused):
        # half the keys (by a hash of the name) bf16, the others fp32: routers, correction biases, sinks, norms and
        # the parts of one fused projection land on both sides
        src = _recast(checkpoint(variant), tmp_path / "mixed", lambda key: zlib.crc32(key.encode()) % 2 == 0)
        before = _all_tensors(src)
        assert {t.dtype for t in before.values()} == {torch.float32, torch.bfloat16}
        load_fused(src, fused, dtype=None).save_hf(tmp_path / "out")
        after = _all_tensors(tmp_path / "out")
        assert_same_tensors(after, before)

    def test_an_explicit_dtype_overrides_the_stored_ones(self, checkpoint, tmp_path):
        src = _recast(checkpoint("qwen3"), tmp_path / "mixed", lambda key: "norm" in key)
        _load(src).save_hf(tmp_path / "out", dtype=torch.float16)
        assert {t.dtype for t in _all_tensors(tmp_path / "out").values()} == {torch.float16}


class TestFromHF:
    def test_meta_build_equals_cpu_build(self, tiny_hf_dir):
        path = tiny_hf_dir("qwen3_tied")
        meta_model, cpu_model = _load(path, device_meta=True), _load(path, device_meta=False)
        assert meta_model.lm_head.weight is meta_model.embed_tokens.weight
        ids = torch.randint(0, 100, (2, 10))
        with torch.no_grad():
            assert torch.equal(meta_model(input_ids=ids).logits, cpu_model(input_ids=ids).logits)

    def test_missing_key_is_named(self, tiny_hf_dir, tmp_path):
        tensors = load_file(tiny_hf_dir("llama") / "model.safetensors")
        tensors.pop("model.layers.1.mlp.up_proj.weight")
        save_file(tensors, tmp_path / "model.safetensors")
        shutil.copy(tiny_hf_dir("llama") / "config.json", tmp_path / "config.json")
        model = get_model_config_from_hf(tmp_path).build()
        with pytest.raises(CheckpointMismatchError, match=r"missing keys \(1\): model.layers.1.mlp.up_proj.weight"):
            model.from_hf(tmp_path)
        missing = model.from_hf(tmp_path, strict=False)
        assert missing == ["model.layers.1.mlp.up_proj.weight"]

    def test_wrong_shape_is_named_even_when_not_strict(self, tiny_hf_dir, tmp_path):
        tensors = load_file(tiny_hf_dir("llama") / "model.safetensors")
        tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 64)
        tensors["model.extra.weight"] = torch.zeros(1)
        save_file(tensors, tmp_path / "model.safetensors")
        shutil.copy(tiny_hf_dir("llama") / "config.json", tmp_path / "config.json")
        model = get_model_config_from_hf(tmp_path).build()
        with pytest.raises(CheckpointMismatchError) as err:
            model.from_hf(tmp_path)
        message = str(err.value)
        assert "layers.0.self_attn.q_proj.weight" in message and "checkpoint (8, 64), model (64, 64)" in message
        assert "unexpected keys (1): model.extra.weight" in message
        with pytest.raises(CheckpointMismatchError, match="shape mismatches"):
            model.from_hf(tmp_path, strict=False)


class TestCheckpointReader:
    def test_reads_only_requested_keys_lazily(self, tiny_hf_dir):
        reader = CheckpointReader(tiny_hf_dir("qwen3"))
        assert reader._handles == {}, "constructing the reader must not open shards for reading"
        assert reader.shape("model.norm.weight") == (64,)
        assert reader.info("model.norm.weight") == ("F32", (64,))
        assert reader._handles == {}, "shapes and dtypes come from the headers"
        reader.load("model.norm.weight")
        assert list(reader._handles) == ["model.safetensors"]
        reader.close()
        assert reader._handles == {}

    def test_missing_directory_and_files(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            CheckpointReader(tmp_path / "nope")
        with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
            CheckpointReader(tmp_path)

    def test_missing_shard_is_named(self, tmp_path):
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(FileNotFoundError, match="shard model-00001-of-00002.safetensors"):
            CheckpointReader(tmp_path)

    def test_index_is_checked_against_shard_headers(self, tiny_hf_dir, tmp_path):
        shutil.copy(tiny_hf_dir("qwen3") / "model.safetensors", tmp_path / "model.safetensors")
        keys = CheckpointReader(tmp_path).keys()
        index = {"weight_map": dict.fromkeys([*keys, "model.ghost.weight"], "model.safetensors")}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointFormatError, match="1 tensor.* not found in model.safetensors.*model.ghost"):
            CheckpointReader(tmp_path)
        index = {"weight_map": dict.fromkeys(keys[1:], "model.safetensors")}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointFormatError, match=f"missing from model.safetensors.index.json, e.g. {keys[0]}"):
            CheckpointReader(tmp_path)
        (tmp_path / "model.safetensors.index.json").write_text("{not json")
        with pytest.raises(CheckpointFormatError, match="is not valid JSON"):
            CheckpointReader(tmp_path)

    def test_unreadable_shard_is_named(self, tmp_path):
        (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(CheckpointFormatError, match="model.safetensors is not a readable safetensors file"):
            CheckpointReader(tmp_path)

    def test_unknown_key(self, tiny_hf_dir):
        with pytest.raises(KeyError, match="not in the checkpoint"):
            CheckpointReader(tiny_hf_dir("qwen3")).load("model.nope")


class TestParseSize:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("5GB", 5 * 10**9),
            ("500MB", 500 * 10**6),
            ("4GiB", 4 * 2**30),
            ("1.5GiB", 3 * 2**29),
            ("2MiB", 2 * 2**20),
            ("1.5KB", 1500),
            ("300kib", 300 * 1024),
            (" 2000B ", 2000),
        ],
    )
    def test_units(self, text, expected):
        assert parse_size(text) == expected

    def test_default_is_transformers_5gb(self):
        assert DEFAULT_MAX_SHARD_SIZE == "5GB"

    @pytest.mark.parametrize("bare", ["5", "0.5", " 77 ", 123, 4.0])
    def test_bare_number_is_rejected_asking_for_a_unit(self, bare):
        with pytest.raises(ShardSizeError, match=r"has no unit; write e.g. 5GB or 4GiB"):
            parse_size(bare)

    @pytest.mark.parametrize("text", ["five gigs", "4 apples", "GB", "", "0GB"])
    def test_garbage_is_rejected(self, text):
        with pytest.raises(ShardSizeError):
            parse_size(text)

    def test_save_hf_rejects_a_bare_number_before_writing(self, tiny_hf_dir, tmp_path):
        model = _load(tiny_hf_dir("qwen3"))
        with pytest.raises(ShardSizeError, match="'5' has no unit"):
            model.save_hf(tmp_path / "out", max_shard_size="5")
        assert not list(tmp_path.iterdir())


def test_safetensors_metadata_marks_pytorch_format(tiny_hf_dir, tmp_path):
    _load(tiny_hf_dir("qwen3")).save_hf(tmp_path / "o")
    with safe_open(tmp_path / "o" / "model-00001-of-00001.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
