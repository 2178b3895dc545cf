"""The ``xtl`` command: every recipe and fragment parses, tiny recipes train, FSDP resume is exact on 2 ranks."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import xtl.cli
from xtl.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
FRAGMENTS = sorted((ROOT / "callbacks").glob("*.yaml"))
SMALL_MODEL = [
    "--model.init_args.model.hidden_size",
    "32",
    "--model.init_args.model.intermediate_size",
    "64",
    "--model.init_args.model.num_hidden_layers",
    "2",
    "--model.init_args.model.head_dim",
    "8",
]


def _tiny_args(config: Path, data_cache: Path, *extra: str) -> list[str]:
    """Arguments that run a tiny recipe quickly: small model, short packs, shared tokenization cache."""
    return [
        "--config",
        str(config),
        *extra,
        "--trainer.enable_progress_bar",
        "false",
        "--data.cache_dir",
        str(data_cache),
        "--data.pack_max_length",
        "128",
        *SMALL_MODEL,
    ]


def _run_main(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)


class TestConfigsParse:
    @pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
    def test_recipe_prints_config(self, recipe, capsys):
        assert _run_main(["fit", "--config", str(recipe), "--print_config"]) == 0
        assert "class_path: xtl.train." in capsys.readouterr().out

    @pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda p: p.name)
    def test_fragment_composes_with_the_default_recipe(self, fragment, capsys):
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(fragment), "--print_config"]
        assert _run_main(args) == 0
        out = capsys.readouterr().out
        assert "ModelCheckpoint" in out, "a fragment must append callbacks, not replace them"
        assert fragment.stem.replace("_", "").lower()[:4] in out.replace("_", "").lower() or "xtl.callbacks" in out

    def test_typo_in_a_key_is_reported(self, capsys):
        assert (
            _run_main(
                [
                    "fit",
                    "--config",
                    str(ROOT / "configs/tiny_sft.yaml"),
                    "--model.init_args.lrr",
                    "1",
                    "--print_config",
                ]
            )
            != 0
        )
        assert "lrr" in capsys.readouterr().err

    def test_a_moved_flat_key_names_its_new_key(self, tmp_path, capsys):
        old = tmp_path / "old.yaml"
        old.write_text("model:\n  class_path: xtl.train.CausalLM\n  init_args:\n    warmup_steps: 10\n")
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(old), "--print_config"]
        assert _run_main(args) == 2
        err = capsys.readouterr().err
        assert "model.init_args.warmup_steps has moved to model.init_args.schedule.warmup_steps" in err
        assert str(old) in err
        assert _run_main(["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--model.init_args.lr=0.1"]) == 2
        assert "--model.init_args.lr has moved to --model.init_args.optimizer.lr" in capsys.readouterr().err

    def test_optimizer_is_chosen_by_class_path(self, tmp_path, capsys):
        args = [
            "fit",
            "--config",
            str(ROOT / "configs/tiny_sft.yaml"),
            "--model.init_args.optimizer.lr",
            "0.25",
            "--print_config",
        ]
        assert _run_main(args) == 0
        out = capsys.readouterr().out
        assert "class_path: xtl.train.AdamWConfig" in out and "lr: 0.25" in out

    def test_help_examples_of_the_tools_run(self, capsys):
        examples = [line.split()[1:] for line in xtl.cli.__doc__.splitlines() if line.strip().startswith("xtl ")]
        tools = [args for args in examples if args[0] not in ("fit", "validate", "test", "predict")]
        assert tools, "xtl --help shows tool examples"
        for args in tools:
            assert main(args) == 0, f"xtl {' '.join(args)}"

    def test_tools_are_dispatched(self, capsys):
        assert _run_main(["memory", "--help"]) == 0
        assert "usage" in capsys.readouterr().out.lower()

    def test_unknown_command(self, capsys):
        assert main(["frobnicate"]) == 2
        assert "unknown command" in capsys.readouterr().err


class TestTinyRecipesRun:
    @pytest.mark.parametrize("recipe", ["tiny_sft.yaml", "tiny_pretrain.yaml", "tiny_moe_sft.yaml"])
    def test_a_few_steps(self, recipe, tmp_path, monkeypatch, data_cache):
        monkeypatch.chdir(tmp_path)
        args = ["fit", *_tiny_args(ROOT / "configs" / recipe, data_cache), "--trainer.max_steps", "2"]
        if recipe != "tiny_pretrain.yaml":
            args += ["--trainer.val_check_interval", "2"]
        assert _run_main(args) == 0
        run = Path("runs") / recipe.removesuffix(".yaml")
        metrics = next(run.glob("logs/version_*/metrics.csv"))
        rows = list(csv.DictReader(metrics.open()))
        assert [r["train/loss"] for r in rows if r.get("train/loss")], "train/loss was not logged"
        assert (run / "checkpoints" / "last.ckpt").exists()
        assert next(run.glob("logs/version_*/config.yaml")).is_file()

    def test_resume_from_the_saved_config(self, tmp_path, monkeypatch, data_cache):
        monkeypatch.chdir(tmp_path)
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "2"]
        assert _run_main(args) == 0
        saved = next(Path("runs/tiny_sft/logs").glob("version_*/config.yaml"))
        assert _run_main(["fit", "--config", str(saved), "--ckpt_path", "last", "--trainer.max_steps", "3"]) == 0
        metrics = sorted(Path("runs/tiny_sft/logs").glob("version_*/metrics.csv"))[-1]
        steps = [int(row["step"]) for row in csv.DictReader(metrics.open()) if row.get("train/loss")]
        assert steps == [2], "the resumed run continues at step 2 of the saved run"

    def test_validate_alone_runs_the_evaluation_callbacks(self, tmp_path, monkeypatch, data_cache):
        monkeypatch.chdir(tmp_path)
        common = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(ROOT / "callbacks/eval.yaml"))
        assert _run_main(["fit", *common, "--trainer.max_steps", "1"]) == 0
        ckpt = "runs/tiny_sft/checkpoints/last.ckpt"
        assert _run_main(["validate", *common, "--ckpt_path", ckpt]) == 0
        metrics = sorted(Path("runs/tiny_sft/logs").glob("version_*/metrics.csv"))[-1]
        logged = {k for row in csv.DictReader(metrics.open()) for k, v in row.items() if v}
        assert {"val/loss", "val/perplexity", "val/token_accuracy", "eval/exact_match"} <= logged


@pytest.mark.distributed
class TestFSDPResume:
    def _fit(self, tmp_path: Path, cache: Path, max_steps: int, ckpt: str | None = None) -> dict[int, str]:
        tmp_path.mkdir(parents=True, exist_ok=True)
        fragment = tmp_path / "fsdp.yaml"
        fragment.write_text(
            "trainer:\n"
            "  devices: 2\n"
            "  strategy:\n"
            "    class_path: xtl.strategies.FSDPStrategy\n"
            "  val_check_interval: null\n"
            "  enable_progress_bar: false\n"
            "  callbacks:\n"
            "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
            "      init_args: {dirpath: ckpt, save_last: true, every_n_train_steps: 5, save_top_k: -1}\n"
            "data:\n"
            "  val_sources: null\n"
        )
        args = [
            sys.executable,
            "-m",
            "xtl",
            "fit",
            "--config",
            str(ROOT / "configs/tiny_sft.yaml"),
            "--config",
            str(fragment),
            "--config",
            str(ROOT / "callbacks/hf_export.yaml"),
            "--trainer.max_steps",
            str(max_steps),
            "--model.init_args.schedule.decay_steps",
            "10",
            "--data.cache_dir",
            str(cache),
            "--data.pack_max_length",
            "128",
            *SMALL_MODEL,
        ]
        if ckpt:
            args += ["--ckpt_path", ckpt]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses = {}
        for metrics in sorted((tmp_path / "runs/tiny_sft/logs").glob("version_*/metrics.csv")):
            for row in csv.DictReader(metrics.open()):
                if row.get("train/loss"):
                    losses[int(row["step"])] = row["train/loss"]
        return losses

    def test_ten_steps_equal_five_plus_resume_five_on_two_ranks(self, tmp_path, data_cache):
        full = self._fit(tmp_path / "full", data_cache, 10)
        self._fit(tmp_path / "split", data_cache, 5)
        assert (tmp_path / "split/ckpt/last.ckpt").is_dir(), "FSDP checkpoints are DCP directories"
        resumed = self._fit(tmp_path / "split", data_cache, 10, ckpt="last")
        assert len(full) == 10
        assert [resumed[s] for s in range(5, 10)] == [full[s] for s in range(5, 10)]
        # rank 0 wrote the HF export from the FSDP shards; it loads in transformers
        export = tmp_path / "full/runs/tiny_sft/hf/final"
        model = AutoModelForCausalLM.from_pretrained(export)
        logits = model(input_ids=torch.arange(12)[None]).logits
        assert logits.shape == (1, 12, 1600) and torch.isfinite(logits).all()
