"""Startup checks shared by the callbacks that read or write later in a run (after a step, at the end of training):
a folder that must be writable, and an error that one rank meets and every rank must raise."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist

from xtl.errors import ConfigError
from xtl.strategies.layout import broadcast_object


def check_writable_folder(trainer: pl.Trainer, folder: Path, key: str) -> None:
    """Refuse, before training starts, a folder that rank 0 could not create or write into later.

    The folder is not created (a run refused for another reason leaves nothing behind): it must be a folder, or its
    nearest existing parent a folder, that this process may write into. Rank 0 checks (it writes the results) and
    every rank raises the same error.

    Args:
        trainer: The run's trainer (every rank must call this).
        folder: The folder, resolved as the callback resolves it when it writes.
        key: The YAML key that set it, e.g. ``HFExport.dirpath``.

    Raises:
        ConfigError: ``folder`` or a parent of it is a file, or the nearest existing folder is not writable.
    """
    reason = _unwritable(folder) if trainer.is_global_zero else None
    reason = broadcast_object(reason, trainer.lightning_module.parallelizer.world_group())
    if reason:
        raise ConfigError(f"{key} {folder}: cannot be written: {reason}; pick a folder that can be created there")


def raise_on_every_rank(group: dist.ProcessGroup | None, error: str | None) -> None:
    """Raise ``error`` of this rank, or the first error of another rank of ``group`` (the run's ranks: the
    parallelizer's ``world_group()``; ``None``: one rank), on every rank (every rank of ``group`` must call this).

    A check that every rank makes on its own (each loads data it will use) may fail on one rank only (a cache on
    one node); the others must stop too instead of waiting for it at the next collective, and rank 0, which prints
    the error, must know it.

    Raises:
        ConfigError: The first rank's error that is not ``None``.
    """
    errors = [error]
    if group is not None:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first:
        raise ConfigError(first)


# ---- private ---------------------------------------------------------------------------------------------------


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` could not be created and written into (an OS error's words), or ``None``."""
    existing = Path(folder).expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # "a/file/x" does not exist: stat fails with "Not a directory" at "a/file"
    if not existing.is_dir():
        return f"{existing} is a file ({os.strerror(errno.ENOTDIR)})"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing}: {os.strerror(errno.EACCES)}"
    return None
