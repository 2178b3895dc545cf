"""Where a run writes, so that a documented command never acts on a stale result.

``trainer.default_root_dir`` (the *run folder*) holds one training run:

- ``config.yaml``: the config of the run's latest ``fit`` (also in ``logs/version_N/``), the one to resume with;
- ``logs/version_N/``: the metrics of the run's fits (the first fit and each resume);
- ``checkpoints/``: its checkpoints, ``last.ckpt`` always the newest state;
- ``validate/``, ``test/``, ``predict/`` ``version_N``: what the evaluation commands log (never mixed into the
  training logs), and ``predictions.jsonl``.

A ``fit`` that starts from scratch into a run folder whose checkpoint folder already holds checkpoints is refused:
the new run would write ``last-v1.ckpt`` beside the old ``last.ckpt``, and every command reading ``last`` would
silently evaluate the older model. A fit that resumes by itself (``--ckpt_path auto``, or a restart:
:mod:`xtl.strategies.restart`) is not refused: it finds those checkpoints and goes on from the newest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.cli import SaveConfigCallback

from xtl.errors import ConfigError
from xtl.strategies.remote_checkpoint import complete_checkpoints, staging_dir_for
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
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():  # URLs stay
            setattr(init_args, key, str(root / value))
    if subcommand in EVAL_SUBCOMMANDS:
        for entry in loggers:
            init_args = _init_args(entry)
            if init_args is not None and "name" in init_args:
                init_args.name = subcommand


def refuse_stale_checkpoints(config: Any) -> None:
    """Refuse a ``fit`` that starts from scratch (the CLI calls it then) when its checkpoint folder holds checkpoints
    of an earlier run.

    Raises:
        ConfigError: Naming the folder, its newest checkpoint and the ways on (resume, another folder, delete).
    """
    for dirpath in checkpoint_folders(config):
        folder = Path(dirpath) if "://" not in dirpath else dirpath
        if isinstance(folder, str):  # an fsspec URL: its complete checkpoints (xtl.strategies.remote_checkpoint)
            found = [c.name for c in complete_checkpoints(folder)]
        elif folder.is_dir():
            found = [p.name for p in sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)]
        else:
            found = []
        if found:
            raise ConfigError(
                f"{folder} already holds the checkpoints of an earlier run (newest: {found[-1]}); a new run "
                "would leave its 'last' checkpoint beside them. Resume that run with --ckpt_path last (or auto), "
                f"write this one elsewhere with --trainer.default_root_dir DIR, or delete {folder}"
            )


def checkpoint_folders(config: Any) -> list[str]:
    """The ``dirpath`` of every checkpoint callback of a subcommand's parsed config (``class_path`` containing
    ``Checkpoint``), in the config's order.

    A relative one is taken relative to ``trainer.default_root_dir`` as :func:`root_outputs_at` makes it (so the
    answer is the same before and after that); a URL (``scheme://...``) is kept as given. A callback without a
    ``dirpath`` (Lightning's default folder inside the logger's version) is left out.
    """
    root = Path(config.trainer.default_root_dir or ".").resolve()
    folders = []
    for callback in config.trainer.callbacks or []:
        init_args = _init_args(callback) if "Checkpoint" in class_path_of(callback) else None
        dirpath = init_args.get("dirpath") if init_args is not None else None
        if isinstance(dirpath, str):
            folders.append(dirpath if "://" in dirpath else str(root / dirpath))
    return folders


def checkpoint_staging_dir(config: Any, checkpoint_url: str) -> Path:
    """The local folder a remote checkpoint ``checkpoint_url`` is downloaded to: the ``staging_dir`` of the
    checkpoint callback whose ``dirpath`` holds it, else the default staging folder of its folder
    (:func:`xtl.strategies.remote_checkpoint.staging_dir_for`)."""
    folder = checkpoint_url.rstrip("/").rsplit("/", 1)[0]
    staging_dir = None
    for callback in config.trainer.callbacks or []:
        init_args = _init_args(callback) if "Checkpoint" in class_path_of(callback) else None
        if init_args is not None and str(init_args.get("dirpath") or "").rstrip("/") == folder:
            staging_dir = init_args.get("staging_dir")
            break
    return staging_dir_for(folder, config.trainer.default_root_dir or ".", staging_dir)


def class_path_of(entry: Any) -> str:
    """The ``class_path`` of a ``class_path`` / ``init_args`` entry of the parsed config (``""`` for another value,
    e.g. a logger given as ``true``)."""
    return str(entry.get("class_path") or "") if isinstance(entry, Namespace) else ""


def _init_args(entry: Any) -> Any:
    """The ``init_args`` of a ``class_path`` / ``init_args`` entry of the parsed config (``None`` for another
    value)."""
    return entry.get("init_args") if isinstance(entry, Namespace) else None
