"""lm-evaluation-harness runs during training, on the model being trained (sharded or not; no export)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from xtl.callbacks._run import run_datamodule
from xtl.callbacks._startup import check_writable_folder, raise_on_every_rank
from xtl.callbacks.lm_eval_run import (
    EvalSettings,
    flat_metrics,
    load_tasks,
    require_lm_eval,
    resolve_tasks,
    run_lm_eval,
)
from xtl.errors import ConfigError
from xtl.strategies.layout import broadcast_object
from xtl.utils import atomic_write_bytes


class LMEval(pl.Callback):
    """Evaluate the model with lm-evaluation-harness every ``every_n_steps`` steps, at the end of training, and with
    every ``xtl validate``.

    The model answers lm-eval's requests in place (:class:`~xtl.callbacks.lm_eval_model.XTLLM`: packed
    log-likelihoods, cached greedy generation); under FSDP or expert parallelism every rank takes a share of the
    requests and rank 0 scores them; under context parallelism a context-parallel group takes a share, each of its
    ranks scoring its part of every packed row. Metrics go to every logger as ``eval/<task>/<metric>`` (at the
    training step), and lm-eval's results as JSON to ``<dirpath>/step_<N>.json``. The training state is left as it
    was: the model's mode, no gradients, and the random generators (lm-eval seeds them for its few-shot sampling; they
    are restored), so a run's losses are the same with and without the callback, and resume stays exact.

    Args:
        tasks: lm-eval task or group names, task YAML files (local JSONL data next to them), or the shipped tiny
            tasks ``tiny_choice`` and ``tiny_exact`` (see :mod:`xtl.callbacks.lm_eval_run`).
        every_n_steps: Period in optimizer steps during fit (0: not during training).
        at_end: Also evaluate when training ends.
        limit: Documents per task (an int), or a fraction of each task (a float < 1); ``None``: all.
        num_fewshot: Few-shot examples per prompt (``None``: the task's setting).
        batch_size: Requests per packed forward and prompts per decoding batch.
        max_gen_toks: Decoding budget of generation tasks that set none.
        apply_chat_template: Render prompts with the run's chat template (the data module's ``template``).
        fewshot_as_multiturn: Few-shot examples as chat turns (with ``apply_chat_template``).
        include_path: Folders of task YAML added to lm-eval's registry.
        seed: Seed of lm-eval's few-shot sampling.
        dirpath: Where the JSON results go (default ``<trainer.default_root_dir>/lm_eval``).
    """

    def __init__(
        self,
        tasks: list[str],
        every_n_steps: int = 0,
        at_end: bool = True,
        limit: int | float | None = None,
        num_fewshot: int | None = None,
        batch_size: int = 16,
        max_gen_toks: int = 256,
        apply_chat_template: bool = False,
        fewshot_as_multiturn: bool = False,
        include_path: list[str] | None = None,
        seed: int = 1234,
        dirpath: str | None = None,
    ) -> None:
        if every_n_steps < 0:
            raise ConfigError(f"LMEval.every_n_steps must be >= 0, got {every_n_steps}")
        try:
            self.settings = EvalSettings(
                tasks=list(tasks),
                limit=limit,
                num_fewshot=num_fewshot,
                batch_size=batch_size,
                max_gen_toks=max_gen_toks,
                apply_chat_template=apply_chat_template,
                fewshot_as_multiturn=fewshot_as_multiturn,
                include_path=list(include_path or []),
                seed=seed,
            )
        except ConfigError as err:
            raise ConfigError(f"LMEval.{err}") from None
        self.every_n_steps = every_n_steps
        self.at_end = at_end
        self.dirpath = dirpath
        self.history: list[tuple[int, dict[str, float]]] = []
        self._resolved: tuple[list, Any] | None = None
        self._built: list | None = None  # the task objects of the startup check, for the first evaluation

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that lm-eval is installed, the results folder can be written, and every task exists and its
        dataset loads (before training starts)."""
        require_lm_eval()
        if run_datamodule(trainer) is None:
            raise ConfigError("LMEval needs xtl's data module (data: in the config) for the tokenizer")
        check_writable_folder(trainer, self.root(trainer), "LMEval.dirpath")
        error = None
        try:
            self._resolved = resolve_tasks(self.settings)
            if stage in (TrainerFn.FITTING, TrainerFn.VALIDATING):  # the commands that evaluate
                self._built = load_tasks(*self._resolved)  # every rank: each evaluates a share of the requests
        except ConfigError as err:
            error = f"LMEval.{err}"
        raise_on_every_rank(pl_module.parallelizer.world_group(), error)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Evaluate every ``every_n_steps`` steps."""
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self._evaluate_and_log(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluate the final model (unless this step was just evaluated)."""
        if self.at_end and not (self.history and self.history[-1][0] == trainer.global_step):
            self._evaluate_and_log(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluate with ``xtl validate`` (results in its table), not with fit's own validation runs."""
        if trainer.state.fn == TrainerFn.VALIDATING and not trainer.sanity_checking:
            metrics = self.evaluate(trainer, pl_module)
            for name, value in metrics.items():
                pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Run the tasks now (every rank must call this); returns the flat metrics on every rank and writes the
        JSON results (rank 0)."""
        from xtl.callbacks.lm_eval_model import XTLLM

        if self._resolved is None:
            self._resolved = resolve_tasks(self.settings)
        datamodule = run_datamodule(trainer)
        group = pl_module.parallelizer.world_group()  # every rank of the layout takes a share of the requests
        lm = XTLLM(
            pl_module.model,
            datamodule.load_tokenizer(),
            batch_size=self.settings.batch_size,
            max_gen_toks=self.settings.max_gen_toks,
            template=datamodule.template,
            template_kwargs=datamodule.template_kwargs,
            group=group,
            context_group=pl_module.parallelizer.meshes.cp_group(),
            whole_sequences=lambda: pl_module.parallelizer.whole_sequences(pl_module.model),
        )
        start = time.perf_counter()
        tasks, manager = self._resolved
        tasks, self._built = self._built or tasks, None  # built tasks serve once: an evaluation changes them
        results = run_lm_eval(lm, self.settings, tasks, manager)
        seconds = time.perf_counter() - start
        metrics = flat_metrics(results) if results is not None else {}
        metrics = broadcast_object(metrics, group)  # scored on the group's first rank
        step = trainer.global_step
        if trainer.is_global_zero and results is not None:
            record = {"step": step, "seconds": seconds, **{k: results.get(k) for k in _RESULT_KEYS}}
            atomic_write_bytes(
                self.root(trainer) / f"step_{step}.json", json.dumps(record, indent=2, default=str).encode()
            )
        self.history.append((step, metrics))
        return metrics

    def root(self, trainer: pl.Trainer) -> Path:
        """The results folder: ``dirpath``, or ``<trainer.default_root_dir>/lm_eval``."""
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "lm_eval"

    # ---- private -----------------------------------------------------------------------------------------------

    def _evaluate_and_log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            metrics = self.evaluate(trainer, pl_module)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


_RESULT_KEYS = ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples")
