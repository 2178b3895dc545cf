"""LoRA export and import: PEFT adapter directories and merged HF models, checked against transformers and peft."""

from __future__ import annotations

import filecmp
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.cli.test_cli import ROOT, _run_main
from xtl.callbacks import HFExport, LoRA, QLoRA
from xtl.errors import ConfigError
from xtl.model import BaseModel, get_model_config_from_hf
from xtl.model.hf import CheckpointMismatchError, CheckpointReader, copy_into
from xtl.model.hf.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merge_lora_transform
from xtl.module.lora import lora_layers
from xtl.ops import hf_impl
from xtl.strategies.parallelize import ModelTransform, SingleDevice, WeightSource, fully_shard_model

ATOL = 1e-5  # fp32 logits: xtl's LoRA model vs. PEFT / the merged model in transformers (observed: <= 1e-6)


def _xtl_lora(hf_dir: Path, *transforms: ModelTransform) -> BaseModel:
    """The xtl model of ``hf_dir`` through the ``parallelize`` sequence with ``transforms`` (weights loaded, eval)."""
    with torch.device("meta"):
        model = get_model_config_from_hf(hf_dir).build()
    return SingleDevice().parallelize(model, list(transforms), WeightSource(hf_dir=hf_dir)).eval()


def _randomize_adapters(model: BaseModel, seed: int = 3) -> None:
    """Non-zero ``lora_B`` (and a fresh ``lora_A``), so an adapter that is lost or misnamed changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    for _, layer in lora_layers(model):
        for factor in (layer.lora_A.weight, layer.lora_B.weight):
            copy_into(factor, 0.2 * torch.randn(factor.shape, generator=generator))  # a DTensor: its shard


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(5))


def _xtl_logits(model: BaseModel, ids: torch.Tensor) -> torch.Tensor:
    with hf_impl(), torch.no_grad():
        return model(input_ids=ids).logits


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _export(model: BaseModel, out: Path, lora: LoRA | None, export: str = "merged", others: tuple = ()) -> Path:
    """``HFExport.export`` of a run with ``lora`` (its ``export`` set) and ``others`` as callbacks, with a stand-in
    for the trainer (every rank calls it)."""
    if lora is not None:
        lora.export = export
    callbacks = [*([lora] if lora else []), *others]
    distributed = dist.is_initialized()
    trainer = SimpleNamespace(
        default_root_dir=str(out),
        datamodule=None,
        is_global_zero=not distributed or dist.get_rank() == 0,
        strategy=SimpleNamespace(barrier=dist.barrier if distributed else lambda: None),
        callbacks=callbacks or [],
    )
    return HFExport(dirpath=str(out)).export(trainer, SimpleNamespace(model=model), "final")


def _load_base(hf_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")


@pytest.fixture(scope="module")
def lora_model(tiny_hf_dir: object) -> tuple[Path, LoRA, BaseModel]:
    """``(hf_dir, callback, model)``: the tiny Qwen3 with default-target adapters, randomized."""
    hf_dir = tiny_hf_dir("qwen3")
    lora = LoRA(rank=4, alpha=8)
    model = _xtl_lora(hf_dir, lora)
    _randomize_adapters(model)
    return hf_dir, lora, model


class TestMergedExport:
    def test_merged_model_loads_in_transformers_with_the_lora_logits(self, lora_model, tmp_path):
        hf_dir, lora, model = lora_model
        target = _export(model, tmp_path, lora, "merged")
        assert not (target / ADAPTER_CONFIG).exists()
        merged = _load_base(target)
        ids = _ids(model.config.vocab_size)
        expected = _xtl_logits(model, ids)
        assert (_hf_logits(_load_base(hf_dir), ids) - expected).abs().max() > 100 * ATOL  # the adapters matter
        torch.testing.assert_close(_hf_logits(merged, ids), expected, rtol=0, atol=ATOL)

    def test_merged_keys_are_the_base_model_keys(self, lora_model, tmp_path):
        hf_dir, lora, model = lora_model
        target = _export(model, tmp_path, lora, "merged")
        index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
        with CheckpointReader(hf_dir) as base:
            assert set(index) == set(base.keys())

    def test_without_adapters_there_is_nothing_to_merge(self, tiny_hf_dir, tmp_path):
        model = _xtl_lora(tiny_hf_dir("qwen3"))
        assert merge_lora_transform(model) is None
        target = _export(model, tmp_path, None)  # no LoRA callback: a plain HF directory
        assert (target / "config.json").is_file() and not (target / ADAPTER_CONFIG).exists()


class TestQLoRAExport:
    def test_merged_nf4_model_loads_in_transformers_with_the_qlora_logits(self, tmp_path):
        _save_nf4_base(tmp_path / "base")
        lora = LoRA(rank=4, alpha=8)
        model = _xtl_lora(tmp_path / "base", lora, QLoRA())
        assert type(model.layers[0].self_attn.q_proj.weight).__name__ == "NF4Tensor"
        _randomize_adapters(model)
        target = _export(model, tmp_path / "out", lora, "merged")  # NF4 weights dequantized, adapters merged
        ids = _ids(model.config.vocab_size)
        torch.testing.assert_close(_hf_logits(_load_base(target), ids), _xtl_logits(model, ids), rtol=0, atol=ATOL)


class TestExportOwner:
    def test_two_transforms_that_write_the_export_are_refused(self, lora_model, tmp_path):
        _, lora, model = lora_model
        with pytest.raises(ConfigError, match="LoRA, LoRA each write the HF export their own way; keep one of them"):
            _export(model, tmp_path, lora, "merged", others=(LoRA(),))

    def test_an_unknown_export_is_refused(self):
        with pytest.raises(ConfigError, match=r"LoRA.export must be one of \('merged', 'adapter', 'both'\)"):
            LoRA(export="peft")


class TestAdapterExport:
    def test_peft_loads_the_adapter_with_the_lora_logits(self, lora_model, tmp_path):
        hf_dir, lora, model = lora_model
        target = _export(model, tmp_path, lora, "adapter")
        assert sorted(p.name for p in target.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        config = json.loads((target / ADAPTER_CONFIG).read_text())
        assert config["base_model_name_or_path"] == str(hf_dir) and config["revision"] is None
        assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
        assert config["target_modules"] == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        with safe_open(str(target / ADAPTER_WEIGHTS), framework="pt") as file:
            assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in set(file.keys())
            assert len(list(file.keys())) == 2 * 7 * model.config.num_hidden_layers
        peft_model = PeftModel.from_pretrained(_load_base(hf_dir), target)
        ids = _ids(model.config.vocab_size)
        torch.testing.assert_close(_hf_logits(peft_model, ids), _xtl_logits(model, ids), rtol=0, atol=ATOL)

    def test_both_writes_the_merged_model_and_the_adapter_beside_it(self, lora_model, tmp_path):
        hf_dir, lora, model = lora_model
        target = _export(model, tmp_path, lora, "both")
        assert (target / "config.json").is_file() and (target / "adapter" / ADAPTER_WEIGHTS).is_file()
        ids = _ids(model.config.vocab_size)
        expected = _xtl_logits(model, ids)
        torch.testing.assert_close(_hf_logits(_load_base(target), ids), expected, rtol=0, atol=ATOL)
        peft_model = PeftModel.from_pretrained(_load_base(hf_dir), target / "adapter")
        torch.testing.assert_close(_hf_logits(peft_model, ids), expected, rtol=0, atol=ATOL)

    def test_a_subset_of_layers_is_named_by_full_paths(self, tiny_hf_dir, tmp_path):
        hf_dir = tiny_hf_dir("qwen3")
        lora = LoRA(rank=2, alpha=4, target_modules=["layers.0.self_attn.q_proj", "down_proj"], use_rslora=True)
        model = _xtl_lora(hf_dir, lora)
        _randomize_adapters(model)
        target = _export(model, tmp_path, lora, "adapter")
        config = json.loads((target / ADAPTER_CONFIG).read_text())
        assert config["target_modules"] == [
            "model.layers.0.mlp.down_proj",
            "model.layers.0.self_attn.q_proj",
            "model.layers.1.mlp.down_proj",
        ]
        peft_model = PeftModel.from_pretrained(_load_base(hf_dir), target)
        ids = _ids(model.config.vocab_size)
        torch.testing.assert_close(_hf_logits(peft_model, ids), _xtl_logits(model, ids), rtol=0, atol=ATOL)


def _peft_adapter(hf_dir: Path, out: Path, **config: object) -> PeftModel:
    """A PEFT-written adapter of ``hf_dir`` with random (non-zero) factors, saved to ``out``."""
    torch.manual_seed(7)
    peft_model = get_peft_model(_load_base(hf_dir), LoraConfig(init_lora_weights=False, **config))
    peft_model.save_pretrained(out)
    return peft_model


class TestAdapterLoading:
    @pytest.mark.parametrize(
        "targets",
        [["q_proj", "v_proj", "mlp.up_proj"], r"model\.layers\.0\.self_attn\.(q|o)_proj"],
        ids=["list", "regex"],
    )
    def test_peft_adapter_gives_the_peft_logits_and_trains_only_adapters(self, tiny_hf_dir, tmp_path, targets):
        hf_dir = tiny_hf_dir("qwen3")
        peft_model = _peft_adapter(hf_dir, tmp_path / "adapter", r=3, lora_alpha=5, target_modules=targets)
        lora = LoRA(rank=16, alpha=1.0, target_modules=["gate_proj"], adapter_path=str(tmp_path / "adapter"))
        assert (lora.rank, lora.alpha) == (3, 5)  # the adapter's config wins
        model = _xtl_lora(hf_dir, lora)
        expected_layers = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "lora_A" in m._modules}
        assert {f"base_model.model.model.{n}" for n, _ in lora_layers(model)} == expected_layers
        ids = _ids(model.config.vocab_size)
        torch.testing.assert_close(_xtl_logits(model, ids), _hf_logits(peft_model, ids), rtol=0, atol=ATOL)

        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
        assert changed == set(model.adapter_tensors())

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("peft_type", "IA3"),
            ("bias", "all"),
            ("fan_in_fan_out", True),
            ("modules_to_save", ["lm_head"]),
            ("use_dora", True),
            ("rank_pattern", {"q_proj": 2}),
            ("alpha_pattern", {"q_proj": 2}),
            ("init_lora_weights", "pissa"),
        ],
    )
    def test_unsupported_settings_name_the_file_and_key(self, tmp_path, key, value):
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], key: value}
        (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=rf"{tmp_path / ADAPTER_CONFIG}: {key}=.* is not supported"):
            LoRA(adapter_path=str(tmp_path))

    def test_missing_config_is_a_config_error(self, tmp_path):
        with pytest.raises(ConfigError, match="LoRA.adapter_path: .*adapter_config.json does not exist"):
            LoRA(adapter_path=str(tmp_path))

    def test_adapter_keys_that_do_not_match_are_named(self, tiny_hf_dir, tmp_path):
        hf_dir = tiny_hf_dir("qwen3")
        _peft_adapter(hf_dir, tmp_path, r=2, lora_alpha=4, target_modules=["q_proj"])
        config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
        (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules": ["q_proj", "k_proj"]}))
        with pytest.raises(CheckpointMismatchError) as err:
            _xtl_lora(hf_dir, LoRA(adapter_path=str(tmp_path)))
        message = str(err.value)
        assert str(tmp_path / ADAPTER_WEIGHTS) in message
        assert "missing keys (4): base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight" in message


class TestCLI:
    def test_fit_with_lora_writes_a_peft_adapter(self, tmp_path, monkeypatch, data_cache):
        monkeypatch.chdir(tmp_path)
        config = Qwen3Config(
            vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        )  # fmt: skip
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(tmp_path / "base")
        fragment = tmp_path / "lora.yaml"
        fragment.write_text((ROOT / "callbacks/lora.yaml").read_text().replace("export: merged", "export: adapter"))
        args = [
            "fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(fragment),
            "--config", str(ROOT / "callbacks/hf_export.yaml"), "--model.init_args.model", str(tmp_path / "base"),
            "--trainer.enable_progress_bar", "false", "--data.cache_dir", str(data_cache),
            "--data.pack_max_length", "128", "--trainer.max_steps", "2", "--trainer.default_root_dir", "run",
        ]  # fmt: skip
        assert _run_main(args) == 0
        final = tmp_path / "run" / "hf" / "final"
        assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json"} <= {p.name for p in final.iterdir()}
        assert json.loads((final / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(tmp_path / "base")
        peft_model = AutoPeftModelForCausalLM.from_pretrained(final)  # finds the base model through the config
        lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
        assert len(lora_b) == 7 * 2 and all(p.abs().sum() > 0 for p in lora_b)  # trained: B is no longer zero


def _fsdp_worker(rank: int, world: int, port: int, hf_dir: str, out: str, qlora: bool = False) -> None:
    """Shard the LoRA model (``qlora``: with NF4 base weights) over ``world`` gloo ranks, export ``both``, then load
    the adapter into a fresh sharded model; rank 0 saves the reloaded factors."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    def sharded(lora: LoRA) -> BaseModel:  # the parallelize order: transform, shard, load, after_weights
        with torch.device("meta"):
            model = lora.transform_model(get_model_config_from_hf(Path(hf_dir)).build())
        fully_shard_model(model, mesh=mesh)
        model.from_hf(hf_dir)
        model = lora.after_weights(model)
        return QLoRA().after_weights(model) if qlora else model

    lora = LoRA(rank=4, alpha=8)
    model = sharded(lora)
    _randomize_adapters(model)
    target = _export(model, Path(out), lora, "both")
    reloaded = sharded(LoRA(adapter_path=str(target / "adapter")))
    factors = {name: t.full_tensor() for name, t in reloaded.adapter_tensors().items()}
    if qlora:  # the sharded NF4 weights are there
        assert type(model.layers[0].self_attn.q_proj.weight.to_local()).__name__ == "NF4Tensor"
    if rank == 0:
        torch.save(factors, Path(out) / "reloaded.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
class TestFSDP:
    def test_two_sharded_ranks_export_and_reload_what_one_process_does(self, tiny_hf_dir, tmp_path):
        hf_dir = tiny_hf_dir("qwen3")
        sharded_out, plain_out = tmp_path / "sharded", tmp_path / "plain"
        mp.spawn(_fsdp_worker, args=(2, _free_port(), str(hf_dir), str(sharded_out)), nprocs=2, join=True)
        lora = LoRA(rank=4, alpha=8)
        model = _xtl_lora(hf_dir, lora)
        _randomize_adapters(model)
        _export(model, plain_out, lora, "both")
        for name in ("model-00001-of-00001.safetensors", f"adapter/{ADAPTER_WEIGHTS}"):
            assert filecmp.cmp(sharded_out / "final" / name, plain_out / "final" / name, shallow=False), name
        reloaded = torch.load(sharded_out / "reloaded.pt")
        assert reloaded.keys() == model.adapter_tensors().keys()
        assert all(torch.equal(reloaded[k], v) for k, v in model.adapter_tensors().items())

    def test_two_sharded_qlora_ranks_export_what_one_process_does(self, tmp_path):
        # FSDP QLoRA: the merged export dequantizes the gathered NF4 weights, which are one process's NF4 values
        _save_nf4_base(tmp_path / "base")
        sharded_out, plain_out = tmp_path / "sharded", tmp_path / "plain"
        args = (2, _free_port(), str(tmp_path / "base"), str(sharded_out), True)
        mp.spawn(_fsdp_worker, args=args, nprocs=2, join=True)
        lora = LoRA(rank=4, alpha=8)
        model = _xtl_lora(tmp_path / "base", lora, QLoRA())
        _randomize_adapters(model)
        _export(model, plain_out, lora, "both")
        for name in ("model-00001-of-00001.safetensors", f"adapter/{ADAPTER_WEIGHTS}"):
            assert filecmp.cmp(sharded_out / "final" / name, plain_out / "final" / name, shallow=False), name
        reloaded = torch.load(sharded_out / "reloaded.pt")
        assert all(torch.equal(reloaded[k], v) for k, v in model.adapter_tensors().items())


def _save_nf4_base(path: Path) -> None:
    """A seeded tiny Qwen3 whose 128 x 128 and 256 x 128 weights are whole NF4 blocks, saved by transformers."""
    config = Qwen3Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
