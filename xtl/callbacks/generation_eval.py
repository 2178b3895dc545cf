"""Generation-based evaluation: greedy answers to held-out prompts, scored by exact match or containment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from xtl.callbacks._run import run_datamodule
from xtl.data.item import DataError
from xtl.errors import ConfigError
from xtl.strategies.capability import ContextParallelFeature, Refusal
from xtl.train.generation import GenerationConfig, chat_prompt_ids, generate, split_thinking
from xtl.utils import resolve_path


class GenerationEval(pl.Callback, ContextParallelFeature):
    """Greedy-decode the prompts of a JSONL eval set and log the share of correct answers.

    Each line holds ``messages`` (the last assistant turn, if present, is dropped from the prompt) and the expected
    ``answer`` (default: that assistant turn's content). The prompt is rendered with the datamodule's tokenizer
    chat template and a generation prompt; decoding (cached, ``batch_size`` prompts at a time) stops at the
    tokenizer's EOS or the template's stop token, and a leading thinking block (``... </think>``) is removed before
    scoring. Runs every ``every_n_steps`` optimizer steps during fit, and at the end of each validation epoch (so
    ``xtl validate`` runs it too).

    Args:
        path: JSONL file (``tiny:sft_eval.jsonl`` is the embedded tiny task's held-out set).
        metric: ``exact_match`` (stripped strings equal) or ``contains`` (expected answer is a substring).
        every_n_steps: Period during fit (0: only with validation).
        max_samples: Evaluate the first ``max_samples`` lines.
        max_new_tokens: Decoding budget per prompt.
        name: Metric name suffix: logs ``eval/<name>``.
        batch_size: Prompts decoded together.
    """

    def __init__(
        self,
        path: str = "tiny:sft_eval.jsonl",
        metric: Literal["exact_match", "contains"] = "exact_match",
        every_n_steps: int = 0,
        max_samples: int = 64,
        max_new_tokens: int = 16,
        name: str | None = None,
        batch_size: int = 32,
    ) -> None:
        if metric not in ("exact_match", "contains"):
            raise ValueError(f"GenerationEval.metric must be exact_match or contains, got {metric!r}")
        if batch_size < 1:
            raise ValueError(f"GenerationEval.batch_size must be >= 1, got {batch_size}")
        self.path = path
        self.metric = metric
        self.every_n_steps = every_n_steps
        self.max_samples = max_samples
        self.max_new_tokens = max_new_tokens
        self.name = name or metric
        self.batch_size = batch_size
        self.history: list[tuple[int, float]] = []

    def context_parallel_refusal(self, stage: str) -> Refusal | None:
        """Refused under context parallelism: decoding runs whole prompts on each process."""
        return Refusal(
            "GenerationEval decodes whole prompts on each process",
            "drop GenerationEval from trainer.callbacks: callbacks/eval.yaml",
        )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Read the eval set and check the data module now (before training), not at the first evaluation."""
        if run_datamodule(trainer) is None:
            raise ConfigError("GenerationEval needs xtl's data module (data: in the config) for the tokenizer")
        self._samples()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Evaluate every ``every_n_steps`` steps."""
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self._evaluate_and_log(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluate with every validation run (not during the sanity check, nor when fit already evaluates on its
        own ``every_n_steps`` schedule)."""
        fitting_on_schedule = trainer.state.fn == TrainerFn.FITTING and self.every_n_steps > 0
        if not trainer.sanity_checking and not fitting_on_schedule:
            self._evaluate_and_log(trainer, pl_module)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        """Score the eval set now; returns the share of correct answers."""
        datamodule = run_datamodule(trainer)
        if datamodule is None:
            raise ConfigError("GenerationEval needs xtl's data module (data: in the config) for the tokenizer")
        tokenizer = datamodule.load_tokenizer()
        template, kwargs = datamodule.template, datamodule.template_kwargs
        config = GenerationConfig(max_new_tokens=self.max_new_tokens).with_tokenizer(tokenizer, template)
        stop = set(config.stop_token_ids)
        samples = self._samples()
        correct = 0
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            prompts = [chat_prompt_ids(tokenizer, messages, template, kwargs) for messages, _ in chunk]
            outputs = generate(pl_module.model, prompts, config).sequences
            for (_, answer), out in zip(chunk, outputs):
                text = tokenizer.decode([t for t in out if t not in stop], skip_special_tokens=False)
                _, text = split_thinking(text)  # score the answer, not a (possibly empty) thinking block
                correct += int(text == answer.strip() if self.metric == "exact_match" else answer.strip() in text)
        return correct / max(1, len(samples))

    def _evaluate_and_log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Score and log ``eval/<name>`` through the module, so that a validation run shows it in its results table
        as well as in the loggers (every rank scored the same prompts: no reduction)."""
        with torch.no_grad():
            score = self.evaluate(trainer, pl_module)
        self.history.append((trainer.global_step, score))
        in_validation = trainer.validating or trainer.sanity_checking or trainer.state.stage == "validate"
        pl_module.log(
            f"eval/{self.name}", float(score), on_step=not in_validation, on_epoch=in_validation, batch_size=1
        )

    def _samples(self) -> list[tuple[list[dict], str]]:
        path = Path(resolve_path(self.path))
        if not path.is_file():
            raise DataError(f"GenerationEval: {path} does not exist")
        samples = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if len(samples) >= self.max_samples:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    messages = list(row["messages"])
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise DataError(f"{path}:{lineno}: expected a JSON object with 'messages' ({err})") from err
                answer = row.get("answer")
                if messages and messages[-1].get("role") == "assistant":
                    answer = answer if answer is not None else messages[-1].get("content", "")
                    messages = messages[:-1]
                if answer is None:
                    raise DataError(f"{path}:{lineno}: no 'answer' and no final assistant turn to compare against")
                samples.append((messages, str(answer)))
        return samples
