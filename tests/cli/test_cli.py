"""The ``xtl`` command: every recipe and fragment parses, tiny recipes train, FSDP resume is exact on 2 ranks."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import xtl.command
from xtl.cli import bf16_fallback
from xtl.command import main
from xtl.model import get_model_config_from_hf
from xtl.train.generation import GenerationConfig, chat_prompt_ids, generate, split_thinking, stop_token_ids

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
FRAGMENTS = sorted((ROOT / "callbacks").glob("*.yaml"))
# fragments of another objective than SFT -> the recipe they follow
FRAGMENT_RECIPES = {"agent_tools.yaml": "tiny_grpo.yaml"}
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
        recipe = FRAGMENT_RECIPES.get(fragment.name, "tiny_sft.yaml")
        args = ["fit", "--config", str(ROOT / "configs" / recipe), "--config", str(fragment), "--print_config"]
        assert _run_main(args) == 0
        out = capsys.readouterr().out
        assert "TrainingCheckpoint" in out, "a fragment must append callbacks, not replace them"
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
        old.write_text("model:\n  class_path: xtl.train.LanguageModule\n  init_args:\n    warmup_steps: 10\n")
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(old), "--print_config"]
        assert _run_main(args) == 2
        err = capsys.readouterr().err
        assert "model.init_args.warmup_steps has moved to model.init_args.schedule.warmup_steps" in err
        assert str(old) in err
        assert _run_main(["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--model.init_args.lr=0.1"]) == 2
        assert "--model.init_args.lr has moved to --model.init_args.optimizer.lr" in capsys.readouterr().err

    @pytest.mark.parametrize(
        ("yaml_text", "says"),
        [
            (
                "model:\n  class_path: xtl.train.MoECausalLM\n",
                "model.class_path xtl.train.MoECausalLM: one xtl.train.LanguageModule trains every model family; "
                "write model.class_path: xtl.train.LanguageModule, with balance_loss_coef",
            ),
            (
                "model:\n  class_path: xtl.train.LanguageModule\n  init_args:\n    z_loss_coef: 0.1\n",
                "model.init_args.z_loss_coef has moved to model.init_args.routing.z_loss_coef",
            ),
            (
                "model:\n  init_args:\n    freeze_vision: true\n",
                "model.init_args.freeze_vision has moved to model.init_args.freeze (a list of parts: "
                "freeze: [vision])",
            ),
            (
                "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.LoRA\n"
                "      init_args: {quantize_base: nf4}\n",
                "LoRA.init_args.quantize_base has moved: QLoRA is its own callback: drop quantize_base and add "
                "--config callbacks/qlora.yaml",
            ),
            (
                "trainer:\n  callbacks:\n    - class_path: xtl.callbacks.HFExport\n      init_args: {lora: adapter}\n",
                "HFExport.init_args.lora has moved: what a LoRA model exports is the LoRA callback's export",
            ),
            (
                "model:\n  class_path: xtl.rl.GRPOModule\n  init_args:\n    dynamic_sampling: true\n",
                "model.init_args.dynamic_sampling has moved to model.init_args.rollout.dynamic_sampling (GRPOModule's "
                "settings are grouped under rollout:, updates: and engine:",
            ),
            (
                "model:\n  init_args:\n    engine: vllm\n",
                "model.init_args.engine: vllm has moved to model.init_args.engine.name",
            ),
        ],
    )
    def test_a_recipe_of_an_earlier_release_says_what_to_write(self, tmp_path, capsys, yaml_text, says):
        old = tmp_path / "old.yaml"
        old.write_text(yaml_text)
        assert _run_main(["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(old)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"xtl: error: {old}: ") and says in err

    def test_a_moved_rl_key_on_the_command_line(self, capsys):
        grpo = ["fit", "--config", str(ROOT / "configs/tiny_grpo.yaml")]
        assert _run_main([*grpo, "--model.init_args.epochs", "2"]) == 2
        assert "--model.init_args.epochs has moved to --model.init_args.updates.epochs" in capsys.readouterr().err
        assert _run_main([*grpo, "--model.init_args.engine", "ray"]) == 2
        assert "--model.init_args.engine: ray has moved to --model.init_args.engine.name" in capsys.readouterr().err

    def test_a_folded_module_on_the_command_line(self, capsys):
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--model.class_path", "xtl.train.VisionLM"]
        assert _run_main(args) == 2
        assert "freeze_<part>: true as model.init_args.freeze: [<part>]" in capsys.readouterr().err
        with pytest.raises(ImportError, match="one xtl.train.LanguageModule trains every model family"):
            from xtl.train import CausalLM  # noqa: F401

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

    def test_any_torch_optimizer_by_class_path(self, tmp_path, capsys):
        optimizer = {
            "class_path": "xtl.train.TorchOptimizer",
            "init_args": {"name": "SGD", "kwargs": {"momentum": 0.9}},
        }
        args = [
            "fit",
            "--config",
            str(ROOT / "configs/tiny_sft.yaml"),
            "--model.init_args.optimizer",
            json.dumps(optimizer),
        ]
        assert _run_main([*args, "--print_config"]) == 0
        out = capsys.readouterr().out
        assert "class_path: xtl.train.TorchOptimizer" in out and "name: SGD" in out and "momentum: 0.9" in out
        optimizer["init_args"]["kwargs"] = {"momentun": 0.9}
        args[-1] = json.dumps(optimizer)
        assert _run_main([*args, "--trainer.default_root_dir", str(tmp_path)]) == 2  # refused when instantiated
        assert "SGD takes no argument 'momentun' (did you mean 'momentum'?)" in capsys.readouterr().err

    def test_help_examples_of_the_tools_run(self, capsys):
        examples = [line.split()[1:] for line in xtl.command.__doc__.splitlines() if line.strip().startswith("xtl ")]
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
        logged = next(run.glob("logs/version_*/config.yaml"))
        assert (run / "config.yaml").read_bytes() == logged.read_bytes()
        assert yaml.safe_load(logged.read_text())["trainer"]["max_steps"] == 2

    def test_default_root_dir_moves_everything_the_run_writes(self, tmp_path, monkeypatch, data_cache):
        work, out = tmp_path / "work", tmp_path / "out"
        work.mkdir()
        monkeypatch.chdir(work)
        args = _tiny_args(
            ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(ROOT / "callbacks/hf_export.yaml")
        )
        assert _run_main(["fit", *args, "--trainer.default_root_dir", str(out), "--trainer.max_steps", "2"]) == 0
        assert not any(work.iterdir()), f"written outside default_root_dir: {sorted(work.rglob('*'))}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "work"]
        assert (out / "checkpoints" / "last.ckpt").is_file() and (out / "hf" / "final" / "config.json").is_file()
        assert next(out.glob("logs/version_*/metrics.csv")).is_file()
        assert next(out.glob("logs/version_*/config.yaml")).is_file()

    def test_resume_from_the_saved_config(self, tmp_path, monkeypatch, data_cache):
        monkeypatch.chdir(tmp_path)
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "2"]
        assert _run_main(args) == 0
        saved = next(Path("runs/tiny_sft/logs").glob("version_*/config.yaml"))
        assert _run_main(["fit", "--config", str(saved), "--ckpt_path", "last", "--trainer.max_steps", "3"]) == 0
        metrics = sorted(Path("runs/tiny_sft/logs").glob("version_*/metrics.csv"))[-1]
        steps = [int(row["step"]) for row in csv.DictReader(metrics.open()) if row.get("train/loss")]
        assert steps == [2], "the resumed run continues at step 2 of the saved run"

    def test_extending_a_finished_run_continues_its_epoch_and_steps(self, tmp_path, monkeypatch, data_cache):
        """The last checkpoint of a run that ended at max_steps with validation: extended, it goes on at step 2."""
        monkeypatch.chdir(tmp_path)
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.val_check_interval", "2"]
        assert _run_main([*args, "--trainer.max_steps", "2"]) == 0
        assert _run_main([*args, "--trainer.max_steps", "4", "--ckpt_path", "last"]) == 0
        metrics = sorted(Path("runs/tiny_sft/logs").glob("version_*/metrics.csv"))[-1]
        rows = [row for row in csv.DictReader(metrics.open()) if row.get("train/loss")]
        assert [(row["epoch"], row["step"]) for row in rows] == [("0", "2"), ("0", "3")]

    def test_a_fresh_fit_over_an_earlier_runs_checkpoints_is_refused(self, tmp_path, monkeypatch, data_cache, capsys):
        """Otherwise it would write last-v1.ckpt and leave last.ckpt to the earlier run, for every later command."""
        monkeypatch.chdir(tmp_path)
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "1"]
        assert _run_main(args) == 0
        capsys.readouterr()
        assert _run_main(args) == 2
        err = capsys.readouterr().err
        assert "already holds the checkpoints of an earlier run (newest: last.ckpt)" in err
        assert "--ckpt_path last" in err and "--trainer.default_root_dir" in err
        assert sorted(p.name for p in Path("runs/tiny_sft/checkpoints").iterdir()) == ["last.ckpt"]

    def test_resuming_a_finished_run_says_how_to_extend_it(self, tmp_path, monkeypatch, data_cache, capsys):
        monkeypatch.chdir(tmp_path)
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "1"]
        assert _run_main(args) == 0
        capsys.readouterr()
        assert _run_main(["fit", "--config", "runs/tiny_sft/config.yaml", "--ckpt_path", "last"]) == 0
        err = capsys.readouterr().err
        assert "the checkpoint is at step 1 and trainer.max_steps is 1: nothing is left to train" in err
        assert "--trainer.max_steps" in err

    def test_validate_alone_runs_the_evaluation_callbacks(self, tmp_path, monkeypatch, data_cache, capsys):
        monkeypatch.chdir(tmp_path)
        common = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(ROOT / "callbacks/eval.yaml"))
        assert _run_main(["fit", *common, "--trainer.max_steps", "1"]) == 0
        ckpt = "runs/tiny_sft/checkpoints/last.ckpt"
        capsys.readouterr()
        assert _run_main(["validate", *common, "--ckpt_path", ckpt]) == 0
        table = capsys.readouterr().out
        assert "val/loss" in table and "eval/exact_match" in table, "the printed results show every metric"
        (metrics,) = Path("runs/tiny_sft/validate").glob("version_*/metrics.csv")  # not among the training logs
        logged = {k for row in csv.DictReader(metrics.open()) for k, v in row.items() if v}
        assert {"val/loss", "val/perplexity", "val/token_accuracy", "eval/exact_match"} <= logged
        assert [p.name for p in Path("runs/tiny_sft/logs").iterdir()] == ["version_0"]


class TestPrecisionDefault:
    def test_tiny_recipe_trains_in_bf16_mixed_where_the_cpu_has_bf16(self, tmp_path, monkeypatch, data_cache):
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            pytest.skip("this CPU has no native bf16: the fallback test covers it")
        monkeypatch.chdir(tmp_path)
        assert (
            _run_main(["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "1"])
            == 0
        )
        saved = yaml.safe_load(next(Path("runs/tiny_sft/logs").glob("version_*/config.yaml")).read_text())
        assert saved["trainer"]["precision"] == "bf16-mixed"

    def test_without_native_bf16_the_run_falls_back_to_fp32_with_a_note(
        self, tmp_path, monkeypatch, data_cache, capsys
    ):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
        monkeypatch.chdir(tmp_path)
        assert (
            _run_main(["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "1"])
            == 0
        )
        assert "not supported natively on this CPU" in capsys.readouterr().err
        saved = yaml.safe_load(next(Path("runs/tiny_sft/logs").glob("version_*/config.yaml")).read_text())
        assert saved["trainer"]["precision"] == "32-true"

    def test_fp32_recipes_and_forced_fp32_are_left_alone(self):
        assert bf16_fallback("32-true", "cpu") is None
        assert bf16_fallback("bf16-mixed", "mps") is None


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
            "    - class_path: xtl.callbacks.TrainingCheckpoint\n"
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
        assert (tmp_path / "split/runs/tiny_sft/ckpt/last.ckpt").is_dir(), "FSDP checkpoints are DCP directories"
        resumed = self._fit(tmp_path / "split", data_cache, 10, ckpt="last")
        assert len(full) == 10
        assert [resumed[s] for s in range(5, 10)] == [full[s] for s in range(5, 10)]
        # rank 0 wrote the HF export from the FSDP shards; it loads in transformers
        export = tmp_path / "full/runs/tiny_sft/hf/final"
        model = AutoModelForCausalLM.from_pretrained(export)
        logits = model(input_ids=torch.arange(12)[None]).logits
        assert logits.shape == (1, 12, 1600) and torch.isfinite(logits).all()


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _transformers_answer(export: Path, conversation: list[dict], max_new_tokens: int) -> str:
    """transformers' greedy answer to the conversation's prompt (a trailing assistant turn dropped), as
    ``xtl predict`` renders and decodes it (stop tokens removed, thinking split off)."""
    tokenizer = AutoTokenizer.from_pretrained(export)
    messages = conversation[:-1] if conversation[-1]["role"] == "assistant" else conversation
    prompt = chat_prompt_ids(tokenizer, messages, "qwen3")
    stops = list(stop_token_ids(tokenizer, "qwen3"))
    model = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops)
    new = [t for t in out[0, len(prompt) :].tolist() if t not in stops]
    return split_thinking(tokenizer.decode(new, skip_special_tokens=False))[1]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """A directory holding a 300-step tiny SFT run (checkpoint and HF export under ``runs/tiny_sft``; it answers)."""
    work = tmp_path_factory.mktemp("tiny_run")
    args = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(ROOT / "callbacks/hf_export.yaml"))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        assert _run_main(["fit", *args, "--trainer.max_steps", "300", "--trainer.val_check_interval", "300"]) == 0
    return work


class TestTestPredictAndGenerate:
    CKPT = "runs/tiny_sft/checkpoints/last.ckpt"

    def test_test_logs_the_test_sets(self, tiny_run, monkeypatch, data_cache):
        monkeypatch.chdir(tiny_run)
        assert (
            _run_main(["test", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--ckpt_path", self.CKPT]) == 0
        )
        metrics = max(Path("runs/tiny_sft").rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
        logged = {k for row in csv.DictReader(metrics.open()) for k, v in row.items() if v}
        assert {"test/loss", "test/perplexity", "test/token_accuracy"} <= logged
        assert not any(key.startswith("val/") for key in logged)

    def test_predict_writes_one_answer_per_prompt(self, tiny_run, monkeypatch, data_cache):
        """Each answer is transformers' greedy answer from the run's HF export (catches empty or wrong answers)."""
        monkeypatch.chdir(tiny_run)
        monkeypatch.setenv("XTL_HF_IMPL", "1")  # transformers' exact ops: greedy tokens equal on near-ties too
        conversations = [
            [{"role": "user", "content": "What is 2+3?"}],
            [{"role": "user", "content": "Repeat: pencil"}, {"role": "assistant", "content": "pencil"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Uppercase: stone"}],
        ]
        prompts = tiny_run / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
        args = [
            "predict",
            *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache),
            "--ckpt_path",
            self.CKPT,
            "--data.predict_source",
            str(prompts),
            "--data.predict_batch_size",
            "2",
            "--trainer.precision",
            "32-true",
        ]
        assert _run_main(args) == 0
        rows = [json.loads(line) for line in Path("runs/tiny_sft/predictions.jsonl").read_text().splitlines()]
        assert [row["messages"] for row in rows] == conversations
        expected = [_transformers_answer(Path("runs/tiny_sft/hf/final"), c, 32) for c in conversations]  # the recipe's
        assert [row["output"] for row in rows] == expected
        assert any(expected), "the tiny model answers something"
        assert not list(Path("runs/tiny_sft").glob(".predictions.jsonl.tmp-*")), "written through a temporary name"
        assert Path("runs/tiny_sft/predictions.jsonl").stat().st_mode & 0o777 == 0o666 & ~_umask()

    def test_options_typed_on_the_command_line_win_over_the_checkpoints(self, tiny_run, monkeypatch, data_cache):
        """Lightning rebuilds the module from the checkpoint's hyperparameters; a typed setting still applies."""
        monkeypatch.chdir(tiny_run)
        monkeypatch.setenv("XTL_HF_IMPL", "1")
        conversation = [{"role": "user", "content": "What is 2+3?"}]
        prompts = tiny_run / "one_prompt.jsonl"
        prompts.write_text(json.dumps({"messages": conversation}) + "\n")
        args = ["predict", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--ckpt_path", self.CKPT]
        args += ["--data.predict_source", str(prompts), "--data.predict_output", "short.jsonl"]
        args += ["--trainer.precision", "32-true", "--model.init_args.generation.max_new_tokens", "4"]
        assert _run_main(args) == 0
        (row,) = [json.loads(line) for line in Path("short.jsonl").read_text().splitlines()]
        assert row["output"] == _transformers_answer(Path("runs/tiny_sft/hf/final"), conversation, 4)
        assert row["output"] != _transformers_answer(Path("runs/tiny_sft/hf/final"), conversation, 32)

    def test_generate_answers_from_the_checkpoint_and_from_its_hf_export(self, tiny_run, monkeypatch, capsys):
        monkeypatch.chdir(tiny_run)
        prompt = ["--prompt", "What is 2+3?", "--max-new-tokens", "8"]
        assert main(["generate", "--model", self.CKPT, *prompt]) == 0
        from_ckpt = capsys.readouterr().out
        assert main(["generate", "--model", "runs/tiny_sft/hf/final", "--template", "qwen3", *prompt]) == 0
        assert capsys.readouterr().out == from_ckpt
        assert from_ckpt.endswith("\n")

    def test_transformers_generate_on_the_export_stops_where_xtl_generate_stops(self, tiny_run):
        """The export carries the tokenizer's special ids (config.json, generation_config.json): transformers'
        ``generate`` with no stop token given ends at the chat template's end of turn, as xtl's decoding does."""
        export = tiny_run / "runs/tiny_sft/hf/final"
        tokenizer = AutoTokenizer.from_pretrained(export)
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 2+3?"}], "qwen3")
        hf = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
        new = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt) :].tolist()
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert len(new) < 64 and new[-1] == end_of_turn, tokenizer.decode(new)
        config = get_model_config_from_hf(export)
        model = config.build()
        model.from_hf(export)
        ours = generate(model.eval(), [prompt], GenerationConfig(max_new_tokens=64).with_tokenizer(tokenizer, "qwen3"))
        assert ours.sequences[0] == new

    def test_outputs_respect_the_umask(self, tiny_run):
        mode = 0o666 & ~_umask()
        export = tiny_run / "runs/tiny_sft/hf/final"
        assert export.stat().st_mode & 0o777 == 0o777 & ~_umask()
        for path in [*export.iterdir(), tiny_run / "runs/tiny_sft/config.yaml"]:
            assert path.stat().st_mode & 0o777 == mode, path

    @pytest.mark.parametrize("model", ["missing.ckpt", "runs", "runs/tiny_sft/logs"])
    def test_generate_rejects_a_bad_path_in_one_line(self, tiny_run, monkeypatch, capsys, model):
        monkeypatch.chdir(tiny_run)
        assert main(["generate", "--model", model, "--prompt", "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and model in err

    def test_generate_rejects_a_bad_option_naming_it(self, tiny_run, monkeypatch, capsys):
        monkeypatch.chdir(tiny_run)
        assert main(["generate", "--model", self.CKPT, "--prompt", "hi", "--top-p", "0"]) == 2
        assert "top_p" in capsys.readouterr().err
