"""Training checkpoints that survive a crash at any moment: atomic writes, integrity checks before loading, recovery.

A single-process checkpoint is one ``torch.save`` file (a zip archive); a distributed one is a DCP directory
(``.metadata``, one ``.distcp`` file per rank, Lightning's ``meta.pt``). Both are written under a temporary name
and renamed (:class:`AtomicCheckpointIO`, ``FSDPStrategy.save_checkpoint``), so a kill leaves the previous
checkpoint intact. Before one is loaded, :func:`checkpoint_problem` reads its structure (zip CRCs; the DCP metadata
and the byte ranges it names), so a torn or corrupt checkpoint gets a short error naming the file and the newest
intact checkpoint beside it instead of a traceback from deep inside ``torch.load``.

Checkpoints in an fsspec URL folder (object stores) are uploaded whole before they count
(:mod:`xtl.strategies.remote_checkpoint`); :func:`find_resume_checkpoint` and :func:`checkpoint_step` take such
folders and checkpoints too.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from xtl.model.hf.errors import CheckpointError
from xtl.strategies.dcp_layout import DCP_METADATA, LIGHTNING_METADATA, dcp_byte_ranges
from xtl.strategies.remote_checkpoint import (
    is_url,
    newest_complete_checkpoint,
    read_checkpoint,
    remote_checkpoint_problem,
)


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


def find_resume_checkpoint(dirpath: str) -> str | None:
    """The checkpoint a run resumes from in its checkpoint folder ``dirpath`` (``--ckpt_path auto``): the newest
    intact one (:func:`newest_intact_checkpoint`, by modification time) once the replacements a crash interrupted are
    finished (:func:`recover_interrupted_replace`), or ``None`` when the folder holds none.

    For an fsspec URL folder: the URL of its most recently committed complete checkpoint
    (:func:`xtl.strategies.remote_checkpoint.newest_complete_checkpoint`); the CLI downloads it
    (:func:`xtl.strategies.remote_checkpoint.fetch`) as it does any ``--ckpt_path`` URL."""
    if is_url(dirpath):
        newest = newest_complete_checkpoint(dirpath)
        return None if newest is None else newest.url
    folder = Path(dirpath)
    recover_interrupted_replace(folder)
    found = newest_intact_checkpoint(folder)
    return None if found is None else str(found)


def checkpoint_step(path: str | Path) -> int:
    """The ``global_step`` a training checkpoint was saved at, read without loading its tensors (a DCP directory:
    from its ``meta.pt``; a file: memory-mapped; a URL: from its manifest)."""
    if is_url(path):
        remote = read_checkpoint(str(path))
        if remote is None:
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {remote_checkpoint_problem(str(path))}")
        return remote.global_step
    path = Path(path)
    source = path / LIGHTNING_METADATA if path.is_dir() else path
    checkpoint = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    return int(checkpoint.get("global_step", 0))


def _dcp_problem(path: Path) -> str | None:
    if not (path / LIGHTNING_METADATA).is_file():
        return f"it has no {LIGHTNING_METADATA} (not a finished distributed checkpoint)"
    try:
        ends = dcp_byte_ranges(path / DCP_METADATA)
    except CheckpointError as err:
        return str(err)
    for relative, end in ends.items():
        file = path / relative
        if not file.is_file():
            return f"its shard {relative} is missing"
        if file.stat().st_size < end:
            return f"its shard {relative} is truncated"
    return None
