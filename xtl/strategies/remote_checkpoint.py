"""Training checkpoints in an fsspec folder (``s3://``, ``gs://``, ``file://``, ``memory://``...) that count only
once their upload is complete.

Object stores have no atomic rename, so a checkpoint is never renamed into place. Each checkpoint ``<folder>/<name>``
(``last.ckpt``, ``epoch=0-step=4.ckpt``) is a prefix holding one upload per save, ``<name>/<token>/<name>`` (the
``torch.save`` file, or the DCP directory with its ``.metadata``, ``.distcp`` shards and ``meta.pt``), and a
manifest ``<name>/manifest.json`` written last, after the upload was checked against the local copy. The manifest
names the upload, the size of each of its files and the step. A reader ignores a checkpoint without a manifest, or
whose files do not have the manifest's sizes.

Replacing a checkpoint (``last.ckpt`` at every save) uploads under a new token, replaces the manifest in one write
and only then deletes the previous upload, so a crash at any moment leaves the previous one counting. The manifest
write is atomic on object stores (a single PUT: a reader sees the old or the new object) and on a POSIX filesystem
(``file://``: written beside, then renamed); other fsspec filesystems write it in place. Deleting removes the
manifest first. What a crash leaves without a manifest (a torn upload, an upload left behind by a replacement) is
removed by :func:`remove_incomplete` at the next fit.

Downloads (resume from a URL) go to ``<staging>/downloads/<token>/<name>``, one process per node at a time (a file
lock), and are reused while that upload is the checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from filelock import FileLock
from fsspec.implementations.local import LocalFileSystem

from xtl.model.hf.errors import CheckpointError
from xtl.strategies.dcp_layout import DCP_METADATA, dcp_byte_ranges

MANIFEST = "manifest.json"
FORMAT = "xtl-checkpoint/1"
DOWNLOADS = "downloads"
DOWNLOADED = ".xtl-download"  # in a download folder: the URL it came from
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP names each rank's files __<rank>_<n>.distcp


@dataclass(frozen=True)
class RemoteCheckpoint:
    """A complete checkpoint in a remote folder, as its manifest describes it."""

    url: str  # <folder>/<name>
    token: str  # the upload the manifest names: <url>/<token>/<name>
    files: dict[str, int]  # path under <url>/<token> -> size in bytes
    global_step: int
    written: float  # time.time() of the commit

    @property
    def name(self) -> str:
        """The checkpoint's name (``last.ckpt``)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]


def is_url(path: Any) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://...``, ``file://...``) rather than a plain local path."""
    return "://" in str(path)


def staging_dir_for(folder_url: str, default_root_dir: str | Path, staging_dir: str | Path | None = None) -> Path:
    """The local folder a checkpoint callback with the remote ``dirpath`` ``folder_url`` writes to before uploading
    (and downloads to): ``staging_dir`` (relative: to ``default_root_dir``), else
    ``<default_root_dir>/.staging/checkpoints-<8 hex digits of the URL>``."""
    root = Path(default_root_dir).resolve()
    if staging_dir is not None:
        return root / staging_dir if not Path(staging_dir).is_absolute() else Path(staging_dir)
    digest = hashlib.sha1(folder_url.rstrip("/").encode()).hexdigest()[:8]
    return root / ".staging" / f"checkpoints-{digest}"


def new_token() -> str:
    """A fresh upload token (one per save; rank 0 makes it and broadcasts it)."""
    return f"{int(time.time())}-{uuid.uuid4().hex[:12]}"


def upload(local: Path, url: str, token: str, rank: int) -> None:
    """Upload this rank's files of the local checkpoint ``local`` to ``<url>/<token>/<name>``.

    A single file is rank 0's; in a DCP directory each rank uploads its own shards (``__<rank>_*.distcp``) and rank 0
    the rest (``.metadata``, ``meta.pt``). This works whether the staging folder is shared by the nodes or local to
    each node (each node then holds its own ranks' shards, rank 0's node the metadata).
    """
    fs, root = fsspec.core.url_to_fs(url)
    for file in _own_files(local, rank):
        dest = f"{root}/{token}/{file.relative_to(local.parent).as_posix()}"
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(file), dest)


def commit(local: Path, url: str, token: str, global_step: int) -> RemoteCheckpoint:
    """Make the upload ``token`` of ``url`` the checkpoint (rank 0, once every rank finished uploading).

    The upload is checked first: every file of the local copy that this process sees has its size remotely, and in a
    DCP directory every byte range its ``.metadata`` names is there. Then the manifest is written (atomically, see
    the module docstring) and the checkpoint's earlier uploads are deleted.

    Raises:
        CheckpointError: The upload is incomplete (nothing was changed: the previous checkpoint still counts).
    """
    fs, root = fsspec.core.url_to_fs(url)
    remote = _listing(fs, f"{root}/{token}")
    problem = _upload_problem(local, remote)
    if problem is not None:
        raise CheckpointError(f"the upload of checkpoint {url} is incomplete ({problem}); it does not count")
    manifest = {"format": FORMAT, "token": token, "files": remote, "global_step": global_step, "written": time.time()}
    _write_atomically(fs, f"{root}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    for entry in _ls(fs, root):
        if entry.rstrip("/").rsplit("/", 1)[-1] not in (MANIFEST, token):
            fs.rm(entry, recursive=True)
    return RemoteCheckpoint(url, token, remote, global_step, manifest["written"])


def read_checkpoint(url: str) -> RemoteCheckpoint | None:
    """The checkpoint at ``url`` as its manifest describes it, or ``None`` without a readable manifest."""
    fs, root = fsspec.core.url_to_fs(url)
    try:
        manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
        if manifest.get("format") != FORMAT:
            return None
        files = {str(k): int(v) for k, v in manifest["files"].items()}
        step, written = int(manifest["global_step"]), float(manifest["written"])
        return RemoteCheckpoint(url.rstrip("/"), str(manifest["token"]), files, step, written)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing, torn or foreign
        return None


def remote_checkpoint_problem(url: str) -> str | None:
    """Why the checkpoint at ``url`` cannot be used, or ``None`` when it is complete."""
    checkpoint = read_checkpoint(url)
    if checkpoint is None:
        return f"it has no complete upload (no readable {MANIFEST}: the upload was interrupted, or it is not there)"
    fs, root = fsspec.core.url_to_fs(url)
    remote = _listing(fs, f"{root}/{checkpoint.token}")
    for path, size in checkpoint.files.items():
        if path not in remote:
            return f"its file {path} is missing"
        if remote[path] != size:
            return f"its file {path} has {remote[path]} bytes, its manifest says {size}"
    return None


def complete_checkpoints(folder_url: str) -> list[RemoteCheckpoint]:
    """The complete ``*.ckpt`` checkpoints of ``folder_url``, oldest commit first."""
    fs, root = fsspec.core.url_to_fs(folder_url)
    found = []
    for name in _checkpoint_names(fs, root):
        checkpoint = read_checkpoint(f"{folder_url.rstrip('/')}/{name}")
        if checkpoint is not None and remote_checkpoint_problem(checkpoint.url) is None:
            found.append(checkpoint)
    return sorted(found, key=lambda c: (c.written, c.global_step))


def newest_complete_checkpoint(folder_url: str, last_only: bool = False) -> RemoteCheckpoint | None:
    """The most recently committed complete checkpoint of ``folder_url`` (``last_only``: among ``last*.ckpt``)."""
    found = [c for c in complete_checkpoints(folder_url) if not last_only or re.match(r"^last(-v\d+)?\.ckpt$", c.name)]
    return found[-1] if found else None


def delete(url: str) -> None:
    """Delete the checkpoint at ``url``: its manifest first (it stops counting), then its uploads."""
    fs, root = fsspec.core.url_to_fs(url)
    try:
        fs.rm_file(f"{root}/{MANIFEST}")
    except FileNotFoundError:
        pass
    fs.invalidate_cache(root)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def remove_incomplete(folder_url: str) -> list[str]:
    """Delete what crashes left in ``folder_url``: checkpoints without a manifest and uploads a manifest does not
    name. Returns the URLs of the checkpoints removed whole. Call it when no upload is running (a fit's start)."""
    fs, root = fsspec.core.url_to_fs(folder_url)
    removed = []
    for name in _checkpoint_names(fs, root):
        url = f"{folder_url.rstrip('/')}/{name}"
        checkpoint = read_checkpoint(url)
        if checkpoint is None:
            delete(url)
            removed.append(url)
            continue
        for entry in _ls(fs, f"{root}/{name}"):
            if entry.rstrip("/").rsplit("/", 1)[-1] not in (MANIFEST, checkpoint.token):
                fs.rm(entry, recursive=True)
    return removed


def fetch(url: str, staging: Path) -> Path:
    """Download the checkpoint at ``url`` to ``<staging>/downloads/<token>/<name>`` and return that local path.

    One process per node downloads (a file lock); the others, and later calls, reuse the finished download. Every
    node downloads the whole checkpoint (a rank may read any shard of a DCP checkpoint when the layout changed).

    Raises:
        CheckpointError: The checkpoint is incomplete or missing, naming the newest complete one beside it.
    """
    problem = remote_checkpoint_problem(url)
    checkpoint = read_checkpoint(url)
    if problem is not None or checkpoint is None:
        folder = url.rstrip("/").rsplit("/", 1)[0]
        newest = next((c for c in reversed(complete_checkpoints(folder)) if c.url != url.rstrip("/")), None)
        hint = f"the newest complete checkpoint there is {newest.url}" if newest else f"none in {folder} is complete"
        raise CheckpointError(f"checkpoint {url} cannot be loaded: {problem}; {hint}")
    target = staging / DOWNLOADS / checkpoint.token
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if not (target / DOWNLOADED).is_file():
            _download(checkpoint, target)
    return target / checkpoint.name


def is_download(path: str | Path) -> bool:
    """Whether the local checkpoint ``path`` is a copy :func:`fetch` downloaded."""
    return (Path(path).parent / DOWNLOADED).is_file()


def remove_download(path: str | Path) -> None:
    """Remove the downloaded copy ``path`` (its download folder and lock)."""
    folder = Path(path).parent
    shutil.rmtree(folder, ignore_errors=True)
    Path(f"{folder}.lock").unlink(missing_ok=True)
    for empty in (folder.parent, folder.parent.parent):  # downloads/ and the staging folder, once empty
        try:
            empty.rmdir()
        except OSError:
            break


def _download(checkpoint: RemoteCheckpoint, target: Path) -> None:
    fs, root = fsspec.core.url_to_fs(checkpoint.url)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for path, size in checkpoint.files.items():
        local = tmp / path
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{root}/{checkpoint.token}/{path}", str(local))
        if local.stat().st_size != size:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"downloading checkpoint {checkpoint.url}: {path} changed while it was read")
    (tmp / DOWNLOADED).write_text(checkpoint.url)
    shutil.rmtree(target, ignore_errors=True)  # a download interrupted before it was marked complete
    os.replace(tmp, target)


def _own_files(local: Path, rank: int) -> list[Path]:
    if local.is_file():
        return [local] if rank == 0 else []
    files = sorted(p for p in local.rglob("*") if p.is_file())
    return [p for p in files if int(m.group(1) if (m := _SHARD.search(p.name)) else 0) == rank]


def _listing(fs: fsspec.AbstractFileSystem, prefix: str) -> dict[str, int]:
    """Path under ``prefix`` -> size of every file there (listed afresh: other ranks upload there too)."""
    fs.invalidate_cache(prefix)  # object store backends cache listings
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    start = len(fs._strip_protocol(prefix).rstrip("/")) + 1
    return {name[start:]: int(info["size"]) for name, info in found.items() if info.get("type") != "directory"}


def _upload_problem(local: Path, remote: dict[str, int]) -> str | None:
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    if not files:
        return f"the local copy {local} is gone"
    for file in files:
        path = file.relative_to(local.parent).as_posix()
        if remote.get(path) != file.stat().st_size:
            return f"{path} has {remote.get(path, 'no')} bytes uploaded of {file.stat().st_size}"
    if local.is_dir():
        try:
            ends = dcp_byte_ranges(local / DCP_METADATA)
        except CheckpointError as err:
            return f"the local copy {err}"
        for relative, end in ends.items():
            path = f"{local.name}/{relative}"
            if remote.get(path, -1) < end:
                return f"the shard {path} has {remote.get(path, 'no')} bytes uploaded of {end}"
    return None


def _write_atomically(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    if isinstance(fs, LocalFileSystem):  # POSIX: beside, then a rename
        tmp = f"{path}.tmp-{os.getpid()}"
        fs.pipe_file(tmp, data)
        os.replace(tmp, path)
    else:  # an object store's PUT replaces the object whole
        fs.pipe_file(path, data)


def _checkpoint_names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    names = (e.rstrip("/").rsplit("/", 1)[-1] for e in _ls(fs, root))
    return sorted(n for n in names if n.endswith(".ckpt") and not n.startswith("."))


def _ls(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The entries of ``path``, listed afresh (object store backends cache listings); none when it does not exist."""
    fs.invalidate_cache(path)
    try:
        return fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
