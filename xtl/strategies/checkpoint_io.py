"""Training checkpoints that survive a crash at any moment: atomic writes, integrity checks before loading, recovery.

A single-process checkpoint is one ``torch.save`` file (a zip archive); a distributed one is a DCP directory
(``.metadata``, one ``.distcp`` file per rank, Lightning's ``meta.pt``). Both are written under a temporary name
and renamed (:class:`AtomicCheckpointIO`, ``FSDPStrategy.save_checkpoint``), so a kill leaves the previous
checkpoint intact. Before one is loaded, :func:`checkpoint_problem` reads its structure (zip CRCs; the DCP metadata
and the byte ranges it names), so a torn or corrupt checkpoint gets a short error naming the file and the newest
intact checkpoint beside it instead of a traceback from deep inside ``torch.load``.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.distributed.checkpoint.metadata import Metadata

from xtl.model.hf.errors import CheckpointError

DCP_METADATA = ".metadata"
LIGHTNING_METADATA = "meta.pt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file beside the target, then ``os.replace``: a crash never leaves a torn file.

    Loading checks the file first (:func:`checkpoint_problem`) and refuses a damaged one with
    :class:`~xtl.model.hf.errors.CheckpointError`.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Save ``checkpoint`` to ``path`` atomically (temporary files of earlier, killed saves are removed)."""
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        get_filesystem(path).makedirs(str(path.parent), exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            stale.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """Load ``path`` after checking it is whole.

        Raises:
            CheckpointError: The file is missing, truncated or corrupt (naming the newest intact checkpoint).
        """
        raise_if_unreadable(Path(path))
        kwargs = {} if map_location is None else {"map_location": map_location}
        return super().load_checkpoint(path, weights_only=weights_only, **kwargs)


def checkpoint_problem(path: Path) -> str | None:
    """Why the training checkpoint at ``path`` cannot be loaded, or ``None`` when it is whole.

    A file must be a complete zip archive whose entries match their CRCs; a DCP directory must hold a readable
    ``.metadata`` and Lightning's ``meta.pt``, and every byte range the metadata names must exist.
    """
    if not path.exists():
        return "it does not exist"
    if path.is_dir():
        return _dcp_problem(path)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"it is not a complete checkpoint file ({err})"
    return f"its entry {bad.split('/', 1)[-1]} is corrupt" if bad else None


def raise_if_unreadable(path: Path) -> None:
    """Raise a :class:`CheckpointError` naming ``path``, what is wrong and the newest intact checkpoint beside it.

    Raises:
        CheckpointError: When :func:`checkpoint_problem` finds a problem.
    """
    problem = checkpoint_problem(path)
    if problem is None:
        return
    intact = newest_intact_checkpoint(path.parent, exclude=path)
    hint = (
        f"the newest intact checkpoint there is {intact}: pass --ckpt_path {intact}"
        if intact is not None
        else f"no intact checkpoint is left in {path.parent}"
    )
    raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}; {hint}")


def newest_intact_checkpoint(directory: Path, exclude: Path | None = None) -> Path | None:
    """The most recently written whole checkpoint (``*.ckpt`` file or DCP directory) in ``directory``."""
    if not directory.is_dir():
        return None
    candidates = [p for p in directory.glob("*.ckpt") if not p.name.startswith(".") and p != exclude]
    for candidate in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        if checkpoint_problem(candidate) is None:
            return candidate
    return None


def recover_interrupted_replace(directory: Path) -> list[Path]:
    """Finish the checkpoint replacements a crash interrupted in ``directory``; returns the restored paths.

    A distributed checkpoint replaces an existing one in two renames (``X -> .X.old``, ``.X.tmp -> X``). Killed
    between them, ``X`` is missing: it is restored from the new copy when that is whole, else from the old one.
    Safe to call from several processes at once.
    """
    restored = []
    for old in directory.glob(".*.ckpt.old") if directory.is_dir() else ():
        target = old.with_name(old.name[1:].removesuffix(".old"))
        if target.exists():
            continue
        new = old.with_name(f".{target.name}.tmp")
        source = new if new.exists() and checkpoint_problem(new) is None else old
        try:
            os.replace(source, target)
            restored.append(target)
        except FileNotFoundError:  # another process restored it first
            continue
    return restored


def _dcp_problem(path: Path) -> str | None:
    if not (path / LIGHTNING_METADATA).is_file():
        return f"it has no {LIGHTNING_METADATA} (not a finished distributed checkpoint)"
    try:
        with (path / DCP_METADATA).open("rb") as f:
            metadata = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as err:
        return f"its {DCP_METADATA} cannot be read ({err})"
    if not isinstance(metadata, Metadata):
        return f"its {DCP_METADATA} is not DCP metadata"
    for info in (metadata.storage_data or {}).values():
        file = path / info.relative_path
        if not file.is_file():
            return f"its shard {info.relative_path} is missing"
        if file.stat().st_size < info.offset + info.length:
            return f"its shard {info.relative_path} is truncated"
    return None
