"""The rollout trace of an RL run: every sample's stages as spans, and a page to look at them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from xtl.callbacks._startup import check_writable_folder
from xtl.errors import ConfigError


class RolloutTrace(pl.Callback):
    """Trace each rollout sample's path (:mod:`xtl.rl.trace`): the agent loop, each generation, tool calls, judging,
    filtering and its final state in the batch, as JSONL spans; at the end of fit, one self-contained HTML page that
    lists the steps and, per step, its samples by stage time, state, reward and filter reason, with a time-line
    (:mod:`xtl.rl.trace_viewer`). Spans carry ids, stages, timings and rewards: no prompt, response or secret.

    Args:
        path: The spans file (relative: under ``trainer.default_root_dir``); rank ``r > 0`` writes
            ``<stem>.rank<r>.jsonl`` beside it. Appended to, so a resumed run continues the file.
        otlp_endpoint: Also export the spans over OTLP/HTTP (e.g. ``http://localhost:4318`` for Jaeger;
            ``pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http``).
        page: Write the HTML page (``<path>`` with ``.html``) at the end of fit.
    """

    def __init__(self, path: str = "traces.jsonl", otlp_endpoint: str | None = None, page: bool = True) -> None:
        self.path = path
        self.otlp_endpoint = otlp_endpoint
        self.page = page
        self._tracer: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a module without rollouts, and a spans folder that cannot be written."""
        from xtl.rl import GRPOModule

        if not isinstance(pl_module, GRPOModule):
            raise ConfigError(
                f"trainer.callbacks: RolloutTrace traces RL rollouts; the model is {type(pl_module).__name__}, "
                "not a GRPOModule: remove the callback"
            )
        if stage == "fit":
            check_writable_folder(trainer, self.file(trainer).parent, "RolloutTrace.path")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the spans file and make it the process's tracer; say where the trace and its page are."""
        from xtl.rl import trace

        path = self.file(trainer)
        self._tracer = trace.Tracer(path, self.otlp_endpoint, service_name="xtl-rollout")
        trace.activate(self._tracer)
        page = f"; its page at the end of fit: {path.with_suffix('.html')}" if self.page else ""
        rank_zero_info(
            f"xtl trace: rollout spans in {path}{page} (or: python -m xtl.rl.trace_viewer {path})"
            + (f"; exported to {self.otlp_endpoint}" if self.otlp_endpoint else "")
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Write the step's spans (a crash loses at most the spans of one step)."""
        if self._tracer is not None:
            self._tracer.flush()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the spans file (after the rollout producer stopped) and write the page."""
        from xtl.rl import trace
        from xtl.rl.trace_viewer import write_page

        if self._tracer is None:
            return
        trace.activate(None)
        self._tracer.close()
        path, self._tracer = self.file(trainer), None
        if self.page and path.is_file():
            rank_zero_info(f"xtl trace: page written to {write_page(path)}")

    def file(self, trainer: pl.Trainer) -> Path:
        """This rank's spans file."""
        path = Path(self.path)
        if not path.is_absolute():
            path = Path(trainer.default_root_dir) / path
        if trainer.global_rank > 0:
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        return path
