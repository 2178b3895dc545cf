"""The tiny agentic recipe (``configs/tiny_agent_grpo.yaml``): the command runs GRPO through the tool loop with the
calculator, logs the tool calls and the held-out exact match, and its single-turn baseline is one override away."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.rl.agent.test_training import CallsFirst
from xtl.command import main
from xtl.rl import GRPOModule
from xtl.rl.trace_viewer import load_spans

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny_agent_grpo.yaml"


@pytest.fixture(scope="module")
def random_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 HF directory with the tiny tokenizer's vocabulary (what the SFT export looks like)."""
    path = tmp_path_factory.mktemp("agent_policy")
    config = Qwen3Config(vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         tie_word_embeddings=True)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _run(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def _small(export: Path, root: Path) -> list[str]:
    """The recipe, shrunk: 2 prompts x 2 completions of 8 tokens a turn, 3 steps, one held-out batch of 4."""
    return [
        "--config", str(RECIPE), "--model.init_args.model", str(export), "--trainer.default_root_dir", str(root),
        "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--model.init_args.rollout.prompts_per_step", "2", "--model.init_args.sampling.group_size", "2",
        "--model.init_args.sampling.max_new_tokens", "8", "--data.predict_batch_size", "4",
    ]  # fmt: skip


def _logged(root: Path) -> dict[str, list[float]]:
    (metrics,) = root.glob("logs/version_*/metrics.csv")
    out: dict[str, list[float]] = {}
    for row in csv.DictReader(metrics.open()):
        for key, value in row.items():
            if value:
                out.setdefault(key, []).append(float(value))
    return out


class TestAgentRecipe:
    def test_grpo_with_the_calculator_calls_it_and_logs_the_held_out_exact_match(
        self, random_export, tmp_path, monkeypatch
    ):
        """A random policy seldom writes a call: the first turn of every rollout calls the calculator
        (:class:`CallsFirst`), the rest is the policy's own. With the rollout trace, each call is a tool span of its
        sample."""
        monkeypatch.chdir(tmp_path)

        def calls_first(module: GRPOModule) -> CallsFirst:
            return CallsFirst(module.model, module.trainer.datamodule.load_tokenizer())

        monkeypatch.setattr(GRPOModule, "_start_engine", calls_first)
        trace = ["--config", str(ROOT / "callbacks" / "rollout_trace.yaml")]
        assert _run(["fit", *_small(random_export, tmp_path / "run"), *trace]) == 0
        logged = _logged(tmp_path / "run")
        spans = load_spans(tmp_path / "run" / "traces.jsonl")
        tools = [s for s in spans if s["stage"] == "tool"]
        assert len(tools) == 2 * 2 * 2, "one calculator span per trajectory (2 rollout batches x 2 prompts x 2)"
        assert all(
            s["chain"].endswith("ToolLoop.rollout -> tool.calculator") and len(s["samples"]) == 1 for s in tools
        )
        assert (tmp_path / "run" / "traces.html").is_file()
        assert logged["rollout/tool_calls"] and min(logged["rollout/tool_calls"]) == 1.0, "one call per trajectory"
        assert max(logged["rollout/tool_errors"]) == 0.0 and max(logged["rollout/malformed_calls"]) == 0.0
        assert min(logged["rollout/turns"]) == 2.0, "the call's result, then the answer"
        assert len(logged["train/loss"]) == 3 and len(logged["val/exact_match"]) == 1
        assert not any(tmp_path.glob("runs")), "everything under default_root_dir"

    def test_the_single_turn_baseline_is_the_same_recipe_without_the_agent(self, random_export, tmp_path, capsys):
        args = ["fit", *_small(random_export, tmp_path / "run")]
        assert _run([*args, "--print_config"]) == 0
        agent = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["agent"]
        assert agent["class_path"] == "xtl.rl.agent.ToolLoop"
        assert agent["init_args"]["tools"] == ["xtl.agent_tools.calculator"]
        assert _run([*args, "--model.init_args.agent", "null", "--print_config"]) == 0
        assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["agent"] is None
