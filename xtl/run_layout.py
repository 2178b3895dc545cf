"""Where a run writes, so that a documented command never acts on a stale result.

``trainer.default_root_dir`` (the *run folder*) holds one training run:

- ``config.yaml``: the config of the run's latest ``fit`` (also in ``logs/version_N/``), the one to resume with;
- ``logs/version_N/``: the metrics of the run's fits (the first fit and each resume);
- ``checkpoints/``: its checkpoints, ``last.ckpt`` always the newest state;
- ``validate/``, ``test/``, ``predict/`` ``version_N``: what the evaluation commands log (never mixed into the
  training logs), and ``predictions.jsonl``.

A ``fit`` without ``--ckpt_path`` into a run folder whose checkpoint folder already holds checkpoints is refused:
the new run would write ``last-v1.ckpt`` beside the old ``last.ckpt``, and every command reading ``last`` would
silently evaluate the older model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.cli import SaveConfigCallback

from xtl.errors import ConfigError
from xtl.utils import atomic_write_bytes

EVAL_SUBCOMMANDS = ("validate", "test", "predict")
RUN_CONFIG = "config.yaml"


class SaveRunConfig(SaveConfigCallback):
    """LightningCLI's config saving, plus ``<default_root_dir>/config.yaml`` for a ``fit`` (rank 0, atomically).

    The run folder's copy is the bytes Lightning has just written to the log folder (one dump of the config: a
    dump validates the whole config again, a noticeable part of a short run's start-up), else a dump of its own.
    """

    _logged: Path | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Note where Lightning writes the config (``trainer.log_dir`` is a collective: every rank asks), then save."""
        if self.save_to_log_dir and not self.already_saved:
            self._logged = Path(trainer.log_dir or trainer.default_root_dir) / self.config_filename
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Write the fit's config to the run folder (rank 0)."""
        if stage != "fit":
            return
        if self._logged is not None and not self.multifile and self._logged.is_file():
            text = self._logged.read_bytes()
        else:
            text = self.parser.dump(self.config, skip_none=False).encode()
        atomic_write_bytes(Path(trainer.default_root_dir) / RUN_CONFIG, text)


def root_outputs_at(config: Any, subcommand: str | None = None) -> None:
    """Make ``trainer.default_root_dir`` the one folder a run writes to.

    Relative ``save_dir`` of the loggers and relative ``dirpath`` of the callbacks (checkpoints, HF exports) are
    taken relative to ``trainer.default_root_dir`` and made absolute, so ``--trainer.default_root_dir DIR`` moves
    everything the run writes (logs, the saved config, checkpoints, exports, reports). Absolute paths stay. An
    evaluation command (``validate``, ``test``, ``predict``) logs under the subcommand's name instead of the
    training logs' name.
    """
    trainer = config.trainer
    root = Path(trainer.default_root_dir or ".").resolve()
    trainer.default_root_dir = str(root)
    loggers = trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]
    for entry, key in [(e, "save_dir") for e in loggers] + [(c, "dirpath") for c in trainer.callbacks or []]:
        init_args = _init_args(entry)
        value = init_args.get(key) if init_args is not None else None
        if isinstance(value, str) and not Path(value).is_absolute():
            setattr(init_args, key, str(root / value))
    if subcommand in EVAL_SUBCOMMANDS:
        for entry in loggers:
            init_args = _init_args(entry)
            if init_args is not None and "name" in init_args:
                init_args.name = subcommand


def refuse_stale_checkpoints(config: Any) -> None:
    """Refuse a fresh ``fit`` whose checkpoint folder holds checkpoints of an earlier run.

    Raises:
        ConfigError: Naming the folder, its newest checkpoint and the three ways on (resume, another folder,
            delete).
    """
    if config.get("ckpt_path"):
        return
    for callback in config.trainer.callbacks or []:
        if "Checkpoint" not in class_path_of(callback):
            continue
        init_args = _init_args(callback)
        dirpath = init_args.get("dirpath") if init_args is not None else None
        folder = Path(dirpath) if isinstance(dirpath, str) else None
        found = sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if folder and folder.is_dir() else []
        if found:
            raise ConfigError(
                f"{folder} already holds the checkpoints of an earlier run (newest: {found[-1].name}); a new run "
                "would leave its 'last' checkpoint beside them. Resume that run with --ckpt_path last, write this "
                f"one elsewhere with --trainer.default_root_dir DIR, or delete {folder}"
            )


def class_path_of(entry: Any) -> str:
    """The ``class_path`` of a ``class_path`` / ``init_args`` entry of the parsed config (``""`` for another value,
    e.g. a logger given as ``true``)."""
    return str(entry.get("class_path") or "") if isinstance(entry, Namespace) else ""


def _init_args(entry: Any) -> Any:
    """The ``init_args`` of a ``class_path`` / ``init_args`` entry of the parsed config (``None`` for another
    value)."""
    return entry.get("init_args") if isinstance(entry, Namespace) else None
