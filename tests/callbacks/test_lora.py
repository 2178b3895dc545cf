"""LoRA: frozen base, adapters only, PEFT math, checkpoints of trainable weights only, exact resume."""

from __future__ import annotations

import csv
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.callbacks.helpers import DENSE, MOE, build, forward
from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main, _tiny_args
from tests.inprocess import run_in_process
from xtl.callbacks import LoRA
from xtl.callbacks.lora import trainable_parameters
from xtl.errors import ConfigError
from xtl.module.lora import lora_layers

FRAGMENT = ROOT / "callbacks" / "lora.yaml"


def _lora_names(model) -> set[str]:
    return {name for name, _ in lora_layers(model)}


class TestTransform:
    def test_only_adapters_train_and_base_names_are_unchanged(self):
        plain, adapted = build(DENSE), build(DENSE, [LoRA(rank=4)])
        base = dict(plain.named_parameters())
        names = dict(adapted.named_parameters())
        assert set(base) <= set(names), "the base parameters keep their names (HF loading by name)"
        trainable = {n for n, p in names.items() if p.requires_grad}
        assert trainable == set(names) - set(base) and all(".lora_" in n for n in trainable)
        assert set(adapted.checkpoint_tensors()) == set(plain.checkpoint_tensors()), "adapters have no HF key"
        assert len(_lora_names(adapted)) == 3 * 7, "q/k/v/o + gate/up/down in each of the 3 layers"

    def test_the_adapted_model_starts_equal_to_the_base_model(self):
        plain, adapted = build(DENSE), build(DENSE, [LoRA(rank=4)])
        assert all(torch.equal(p, dict(adapted.named_parameters())[n]) for n, p in plain.named_parameters())
        assert torch.equal(forward(plain), forward(adapted)), "lora_B starts at zero"
        assert all(layer.lora_B.weight.abs().sum() == 0 for _, layer in lora_layers(adapted))
        assert all(layer.lora_A.weight.abs().sum() > 0 for _, layer in lora_layers(adapted))

    def test_forward_adds_the_scaled_low_rank_update(self):
        model = build(DENSE, [LoRA(rank=4, alpha=8, use_rslora=True)])
        _, layer = next(lora_layers(model))
        torch.nn.init.normal_(layer.lora_B.weight)
        x = torch.randn(3, layer.in_features)
        expected = x @ layer.weight.t() + (x @ layer.lora_A.weight.t() @ layer.lora_B.weight.t()) * 8 / math.sqrt(4)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)

    def test_only_adapters_get_gradients(self):
        model = build(DENSE, [LoRA(rank=4)])
        for _, layer in lora_layers(model):
            torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
        forward(model).backward()
        grads = {n for n, p in model.named_parameters() if p.grad is not None}
        assert grads and all(".lora_" in n for n in grads)
        assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in grads)

    def test_moe_adapts_attention_and_shared_layers_not_routed_experts(self):
        model = build(MOE, [LoRA(rank=2)])
        names = _lora_names(model)
        assert names and not any("experts." in n and "shared" not in n for n in names)
        assert any("self_attn.q_proj" in n for n in names)

    def test_patterns_select_layers_and_a_miss_is_a_clear_error(self):
        model = build(DENSE, [LoRA(rank=2, target_modules=["layers.1.*q_proj", "down_proj"])])
        assert _lora_names(model) == {"layers.1.self_attn.q_proj"} | {f"layers.{i}.mlp.down_proj" for i in range(3)}
        with pytest.raises(ConfigError, match=r"match no linear layer.*'q_proj'"):
            build(DENSE, [LoRA(target_modules=["qkv"])])
        with pytest.raises(ConfigError, match="rank must be >= 1"):
            LoRA(rank=0)

    def test_gaussian_init_follows_peft(self):
        model = build(DENSE, [LoRA(rank=16, init="gaussian")])
        std = torch.cat([layer.lora_A.weight.flatten() for _, layer in lora_layers(model)]).std()
        assert abs(std.item() - 1 / 16) < 0.005

    def test_trainable_share_of_the_tiny_default_is_under_ten_percent(self):
        spec = dict(
            model_type="qwen3", vocab_size=1600, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        )  # fmt: skip
        trainable, total = trainable_parameters(build(spec, [LoRA(rank=8)]))
        assert trainable == 4 * 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 384) * 3)
        assert trainable / total < 0.10


class TestFit:
    def test_trains_adapters_only_with_a_small_checkpoint_and_resumes_exactly(self, tmp_path, data_cache, caplog):
        def run(name: str, steps: int, *extra: str) -> list[str]:
            work = tmp_path / name
            work.mkdir(exist_ok=True)
            args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, *extra)]
            args += ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", "null"]
            args += ["--data.val_sources", "null"]
            cwd = Path.cwd()
            os.chdir(work)
            try:
                assert _run_main(args) == 0
            finally:
                os.chdir(cwd)
            metrics = sorted(work.glob("runs/tiny_sft/logs/version_*/metrics.csv"))[-1]
            return [row["train/loss"] for row in csv.DictReader(metrics.open()) if row.get("train/loss")]

        lora = ("--config", str(FRAGMENT))
        with caplog.at_level(logging.INFO):
            full = run("lora", 4, *lora)
        assert "LoRA: r=8, alpha=16 on 14 layers; trainable parameters" in caplog.text
        plain = run("plain", 4)
        assert full[0] == plain[0], "lora_B = 0: the first step's loss is the base model's"
        assert full[1:] != plain[1:], "the adapters change what trains"
        ckpt = torch.load(tmp_path / "lora/runs/tiny_sft/checkpoints/last.ckpt", weights_only=False)
        assert ckpt["state_dict"] and all(".lora_" in k for k in ckpt["state_dict"])
        lora_size = (tmp_path / "lora/runs/tiny_sft/checkpoints/last.ckpt").stat().st_size
        plain_size = (tmp_path / "plain/runs/tiny_sft/checkpoints/last.ckpt").stat().st_size
        assert lora_size < plain_size / 2, (lora_size, plain_size)
        # exact resume: 2 steps, then 2 more from the step-2 checkpoint == 4 steps in one go
        run("resumed", 2, *lora)
        resumed = run("resumed", 4, *lora, "--ckpt_path", "last")
        assert resumed == full[2:], (resumed, full)


@pytest.mark.distributed
class TestFSDP:
    def test_lora_trains_on_two_fsdp_ranks_like_one_process(self, tmp_path, data_cache):
        fragment = tmp_path / "fsdp.yaml"
        fragment.write_text(
            "trainer:\n  devices: 2\n  strategy: {class_path: xtl.strategies.FSDPStrategy}\n"
            "  val_check_interval: null\n  enable_progress_bar: false\n  precision: 32-true\n"
            "data:\n  val_sources: null\n"
        )
        common = ["--config", str(FRAGMENT), "--trainer.max_steps", "3", "--data.cache_dir", str(data_cache)]
        common += ["--data.pack_max_length", "128", *SMALL_MODEL]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

        def losses(cwd: Path, *extra: str) -> list[float]:
            cwd.mkdir(exist_ok=True)
            args = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs/tiny_sft.yaml")]
            args += [*extra[:2], *common, *extra[2:]]  # a fragment first, overrides after the common ones
            if "--config" in extra[:1]:  # the 2-rank fragment: a second rank re-runs the command line
                proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
                code, output = proc.returncode, proc.stderr
            else:
                code, output = run_in_process(args[3:], cwd)
            assert code == 0, output[-3000:]
            metrics = sorted(cwd.glob("runs/tiny_sft/logs/version_*/metrics.csv"))[-1]
            return [float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")]

        sharded = losses(tmp_path / "fsdp", "--config", str(fragment))
        # a sharded (DCP) checkpoint of the adapters only resumes exactly: 2 steps, then step 3 from it
        losses(tmp_path / "resumed", "--config", str(fragment), "--trainer.max_steps", "2")
        resumed = losses(tmp_path / "resumed", "--config", str(fragment), "--ckpt_path", "last")
        assert resumed == sharded[2:]
        single = losses(
            tmp_path / "single", "--trainer.precision", "32-true", "--data.micro_batches_per_step", "4",
            "--data.val_sources", "null", "--trainer.val_check_interval", "null",
        )  # fmt: skip
        # fp32; 2 ranks x 2 micro-batches vs 1 x 4: only the order of sums differs
        assert sharded == pytest.approx(single, rel=1e-5)
