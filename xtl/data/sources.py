"""Raw data sources: JSONL files (memory-mapped, line-offset table) and Hugging Face ``datasets``.

A source yields raw rows (``dict``) by index and names each row's location (``file:line`` or ``dir[row i]``) for
error messages. Both kinds feed the same tokenize functions.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import xxhash

from xtl.data.item import DataError, DataFileNotFoundError
from xtl.utils import atomic_write_bytes

SourceFormat = Literal["auto", "jsonl", "hf_disk", "parquet", "json"]
SourceKind = Literal["chat", "text", "preference", "unpaired_preference", "prompt"]
BadRowPolicy = Literal["error", "drop"]

_SCAN_CHUNK = 64 << 20
_HASH_CHUNK = 8 << 20
_SAMPLE_BLOCK = 64 << 10


@dataclass
class SourceSpec:
    """One data source and how to tokenize it; a plain dataclass so YAML configs can build it.

    Args:
        path (str): A ``.jsonl`` file, a ``.parquet``/``.json`` file or folder of them, or a ``save_to_disk`` folder.
        kind (str): ``"chat"`` (OpenAI-style ``messages``, rendered with the chat template), ``"text"``
            (pretraining ``{"text": ...}``) or ``"preference"`` (pairs of a chosen and a rejected response to one
            prompt, :mod:`xtl.data.preference`: every row yields two samples, chosen then rejected) or
            ``"unpaired_preference"`` (one response labeled desirable or not, for KTO, :mod:`xtl.data.unpaired`) or
            ``"prompt"`` (prompts with reference answers for RL, read as rows and never tokenized here:
            :mod:`xtl.data.prompts`).
        format (str): ``"auto"`` (from the suffix / folder contents), ``"jsonl"``, ``"hf_disk"``, ``"parquet"``,
            ``"json"``.
        sample_ratio (float): Share of this source in the mix: 2.0 repeats every sample twice, 0.5 keeps a seeded
            half. Applied to tokenized samples (after chunking); for the preference kinds to rows.
        name (str | None): Display name; defaults to the file stem.
        split (str | None): Split to use when ``path`` holds a ``DatasetDict``.
        text_key (str): Field holding the text for ``kind="text"``.
        messages_key (str): Field holding the messages for ``kind="chat"``.
        chunk_size (int | None): ``kind="text"`` only: split documents longer than this many tokens.
        chunk_overlap (int): Tokens repeated (as unsupervised context) at the start of each continuation chunk.
        bad_rows (str): ``kind="preference"`` and ``"unpaired_preference"`` only: a row that cannot be used (a
            missing or empty side, chosen identical to rejected, a response without a supervised token) raises
            ``DataError`` naming its ``file:line`` (``"error"``, the default) or is skipped and counted (``"drop"``).
        match (str | None): ``kind="prompt"`` only: keep the rows whose last user message matches this regular
            expression.
        data_source (str | None): ``kind="prompt"`` only: the rows' data source when a row names none (judgers
            route on it; default: the display name).
        margin_key (str | None): ``kind="preference"`` only, for reward modelling: the row field holding the pair's
            margin (a number; the pair's loss is ``-log sigmoid(r_chosen - r_rejected - margin)``, TRL's ``margin``
            column). A row without it is a bad row (``bad_rows``).
        streaming (bool): Read the rows on the fly instead of tokenizing the source into the cache
            (:mod:`xtl.data.streaming`): ``path`` may then be a glob, a folder or an fsspec URL of shards (JSONL,
            optionally compressed, or ``json`` / ``parquet`` through ``datasets`` streaming). Training sources only
            (all of them or none); ``kind`` ``chat`` or ``text``.
    """

    path: str
    kind: SourceKind = "chat"
    format: SourceFormat = "auto"
    sample_ratio: float = 1.0
    name: str | None = None
    split: str | None = None
    text_key: str = "text"
    messages_key: str = "messages"
    chunk_size: int | None = None
    chunk_overlap: int = 0
    bad_rows: BadRowPolicy = "error"
    match: str | None = None
    data_source: str | None = None
    margin_key: str | None = None
    streaming: bool = False

    @property
    def display_name(self) -> str:
        """The ``name`` if given, else the file or folder stem."""
        return self.name or Path(self.path).stem


class Source(Protocol):
    """What the cache builder needs from a raw source."""

    path: Path

    def __len__(self) -> int: ...

    def fingerprint(self) -> str: ...

    def rows(self, start: int, stop: int) -> list[dict[str, Any] | None]: ...

    def location(self, index: int) -> str: ...


class JsonlSource:
    """A JSONL file read through ``mmap`` with a table of line offsets; blank lines are skipped.

    Rows are parsed lazily, so a forked worker reads only the lines it tokenizes; the mapping is opened once per
    process and shared through the page cache.

    Args:
        path (str | Path): The ``.jsonl`` file.
        hash_memo (FileHashMemo | None): Remembers the content hash between runs (see :class:`FileHashMemo`);
            ``None`` hashes the whole file on every start.
    """

    def __init__(self, path: str | Path, hash_memo: FileHashMemo | None = None) -> None:
        self.path = Path(path)
        self.hash_memo = hash_memo
        _require_exists(self.path)
        if not self.path.is_file():
            raise DataError(f"JSONL source {self.path} is not a file; point `path` at a .jsonl file")
        self._starts: np.ndarray | None = None
        self._ends: np.ndarray | None = None
        self._line_numbers: np.ndarray | None = None
        self._mm: mmap.mmap | bytes | None = None
        self._pid = -1
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        self._index()
        assert self._starts is not None
        return len(self._starts)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_mm"] = None
        state["_pid"] = -1
        return state

    def fingerprint(self) -> str:
        """Content hash of the file (xxh3-128), computed once per instance.

        Returns:
            str: Hex digest.
        """
        if self._fingerprint is None:
            self._fingerprint = _hash(self.path, self.hash_memo)
        return self._fingerprint

    def rows(self, start: int, stop: int) -> list[dict[str, Any] | None]:
        """Parse rows ``start:stop``.

        Args:
            start (int): First row index.
            stop (int): One past the last row index.

        Returns:
            list[dict | None]: Parsed JSON objects.
        """
        return [self.row(i) for i in range(start, stop)]

    def row(self, index: int) -> dict[str, Any]:
        """Parse one row; malformed JSON raises ``DataError`` naming ``file:line``.

        Args:
            index (int): Row index (blank lines are not rows).

        Returns:
            dict: The JSON object.
        """
        self._index()
        assert self._starts is not None and self._ends is not None
        raw = self._buffer()[int(self._starts[index]) : int(self._ends[index])]
        return parse_jsonl_row(raw, self.location(index))

    def location(self, index: int) -> str:
        """``file:line`` (1-based line number) of row ``index``.

        Args:
            index (int): Row index.

        Returns:
            str: The location.
        """
        self._index()
        assert self._line_numbers is not None
        return f"{self.path}:{int(self._line_numbers[index])}"

    def _buffer(self) -> mmap.mmap | bytes:
        if self._mm is None or self._pid != os.getpid():
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            self._pid = os.getpid()
        return self._mm

    def _index(self) -> None:
        if self._starts is not None:
            return
        buf = self._buffer()
        size = len(buf)
        newlines = []
        for offset in range(0, size, _SCAN_CHUNK):
            count = min(_SCAN_CHUNK, size - offset)
            chunk = np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset)
            newlines.append(np.flatnonzero(chunk == 10) + offset)
        nl = np.concatenate(newlines) if newlines else np.zeros(0, dtype=np.int64)
        starts = np.concatenate([[0], nl + 1]).astype(np.int64)
        ends = np.concatenate([nl, [size]]).astype(np.int64)
        line_numbers = np.arange(1, len(starts) + 1, dtype=np.int64)
        lengths = ends - starts
        # A line holding only "\r" (CRLF files) is blank too.
        cr_only = lengths == 1
        if cr_only.any():
            idx = np.flatnonzero(cr_only)
            cr_only[idx] = np.frombuffer(buf, dtype=np.uint8, count=size)[starts[idx]] == 13
        keep = (lengths > 0) & ~cr_only
        self._starts, self._ends, self._line_numbers = starts[keep], ends[keep], line_numbers[keep]


class HFSource:
    """A Hugging Face ``datasets.Dataset``: a ``save_to_disk`` folder, or local parquet/json files.

    Args:
        path (str | Path): Folder or file.
        format (str): ``"hf_disk"``, ``"parquet"`` or ``"json"``.
        split (str | None): Split of a ``DatasetDict``.
        cache_dir (str | Path | None): Where ``datasets`` keeps its Arrow conversion of parquet/json files.
        hash_memo (FileHashMemo | None): Remembers the content hash of every file between runs.
    """

    def __init__(
        self,
        path: str | Path,
        format: Literal["hf_disk", "parquet", "json"],
        split: str | None = None,
        cache_dir: str | Path | None = None,
        hash_memo: FileHashMemo | None = None,
    ) -> None:
        import datasets

        self.path = Path(path)
        self.hash_memo = hash_memo
        _require_exists(self.path)
        self.format = format
        if format == "hf_disk":
            loaded = datasets.load_from_disk(str(self.path))
        else:
            files = [str(p) for p in _data_files(self.path, format)]
            loaded = datasets.load_dataset(
                format, data_files=files, split="train", cache_dir=None if cache_dir is None else str(cache_dir)
            )
        if isinstance(loaded, datasets.DatasetDict):
            names = sorted(loaded.keys())
            if split is None and len(names) == 1:
                split = names[0]
            if split not in loaded:
                raise DataError(
                    f"{self.path} holds a DatasetDict with splits {names}; set `split` on this source to one of them"
                )
            loaded = loaded[split]
        self.dataset = loaded
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def fingerprint(self) -> str:
        """Content hash of every file that makes up the dataset.

        Returns:
            str: Hex digest.
        """
        if self._fingerprint is None:
            files = sorted(p for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else [self.path]
            h = xxhash.xxh3_128()
            for f in files:
                h.update(str(f.relative_to(self.path) if self.path.is_dir() else f.name).encode())
                h.update(_hash(f, self.hash_memo).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def rows(self, start: int, stop: int) -> list[dict[str, Any] | None]:
        """Rows ``start:stop`` as dicts.

        Args:
            start (int): First row index.
            stop (int): One past the last row index.

        Returns:
            list[dict | None]: The rows.
        """
        columns = self.dataset[start:stop]
        keys = list(columns.keys())
        return [dict(zip(keys, values)) for values in zip(*(columns[k] for k in keys))]

    def location(self, index: int) -> str:
        """``path[row i]`` of row ``index``.

        Args:
            index (int): Row index.

        Returns:
            str: The location.
        """
        return f"{self.path}[row {index}]"


def parse_jsonl_row(raw: bytes | str | dict[str, Any], location: str) -> dict[str, Any]:
    """One JSONL line (``location``: its ``file:line`` for errors) as a dict; a dict (a ``datasets`` row) passes
    through.

    Raises:
        DataError: Malformed JSON, invalid UTF-8, or a value that is not an object.
    """
    if isinstance(raw, dict):
        return raw
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "invalid UTF-8"
        column = f", column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise DataError(
            f"{location}: malformed JSON ({reason}{column}); every line of a JSONL file must be one complete JSON "
            "object: fix or delete this line"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(
            f"{location}: expected a JSON object per line, got {type(obj).__name__}; wrap the record as "
            '{"text": ...} or {"messages": [...]}'
        )
    return obj


def open_source(
    spec: SourceSpec, hf_cache_dir: str | Path | None = None, hash_memo: FileHashMemo | None = None
) -> Source:
    """Open the raw source a spec describes.

    Args:
        spec (SourceSpec): The source.
        hf_cache_dir (str | Path | None): Arrow cache for parquet/json conversion.
        hash_memo (FileHashMemo | None): Remembers file content hashes between runs.

    Returns:
        Source: A ``JsonlSource`` or ``HFSource``.
    """
    path = Path(spec.path).expanduser()
    _require_exists(path)
    fmt = spec.format if spec.format != "auto" else _detect_format(path)
    if fmt == "jsonl":
        return JsonlSource(path, hash_memo=hash_memo)
    return HFSource(path, fmt, split=spec.split, cache_dir=hf_cache_dir, hash_memo=hash_memo)


class FileHashMemo:
    """Content hashes of source files, remembered so that a warm start does not read every file again.

    The fingerprint of a file is always its full xxh3-128 content hash; this only decides when to recompute it.
    Rule: a remembered hash is reused when the file's stat signature (size, ``mtime_ns``, ``ctime_ns``, inode) is
    the one recorded with it *and* the xxh3 hash of three sampled blocks (the first, middle and last 64 KiB) still
    matches. Anything else (an edit, ``touch``, a copy or move onto the path, a restored mtime: ``ctime`` still
    moves) re-hashes the whole file; equal content then gives the same fingerprint, so the tokenization cache still
    hits. A file changed (``ctime``) less than ``settle_seconds`` before it was hashed is not remembered, since a
    second write within the file system's timestamp granularity could leave its signature unchanged.

    Records are small JSON files, one per path, written atomically under ``directory``.

    Args:
        directory (str | Path): Where the records live (``<cache_dir>/fingerprints`` for the DataModule).
        settle_seconds (float): Minimum age of the last change before a hash is remembered.
    """

    def __init__(self, directory: str | Path, settle_seconds: float = 2.0) -> None:
        self.directory = Path(directory).expanduser()
        self.settle_seconds = settle_seconds
        self.full_hashes = 0  # files read in full by this memo (for tests and logs)

    def hash(self, path: str | Path) -> str:
        """The content hash of ``path`` (xxh3-128 hex), from the record when the rule allows.

        Args:
            path (str | Path): The file.

        Returns:
            str: Hex digest, equal to :func:`hash_file`.
        """
        path = Path(path).resolve()
        before = _signature(path)
        record_path = self.directory / f"{xxhash.xxh3_64_hexdigest(str(path).encode())}.json"
        sampled = sample_hash(path, before[0])
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            record = None
        if (
            isinstance(record, dict)
            and record.get("path") == str(path)
            and record.get("stat") == before
            and record.get("sampled") == sampled
        ):
            return str(record["hash"])
        digest = hash_file(path)
        self.full_hashes += 1
        after = _signature(path)
        settled = time.time_ns() - after[2] >= self.settle_seconds * 1e9  # ctime: the kernel's time of any change
        if after == before and settled:
            record = {"path": str(path), "stat": after, "sampled": sampled, "hash": digest}
            try:
                atomic_write_bytes(record_path, json.dumps(record).encode())
            except OSError:  # a read-only cache folder only costs the next start a full hash
                pass
        return digest


def sample_hash(path: str | Path, size: int | None = None) -> str:
    """xxh3-128 of the size and of three sampled blocks: the first, middle and last 64 KiB (the whole of a small file).

    Args:
        path (str | Path): The file.
        size (int | None): Its size, if already known.

    Returns:
        str: Hex digest.
    """
    size = Path(path).stat().st_size if size is None else size
    h = xxhash.xxh3_128(str(size).encode())
    with Path(path).open("rb") as f:
        if size <= 3 * _SAMPLE_BLOCK:
            h.update(f.read())
        else:
            for offset in (0, (size - _SAMPLE_BLOCK) // 2, size - _SAMPLE_BLOCK):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BLOCK))
    return h.hexdigest()


def hash_file(path: str | Path) -> str:
    """Stream a file through xxh3-128.

    Args:
        path (str | Path): The file.

    Returns:
        str: Hex digest.
    """
    h = xxhash.xxh3_128()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _signature(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _hash(path: Path, memo: FileHashMemo | None) -> str:
    return hash_file(path) if memo is None else memo.hash(path)


def _require_exists(path: Path) -> None:
    if not path.exists():
        raise DataFileNotFoundError(
            f"data source {path} does not exist (working directory: {Path.cwd()}); fix the `path` of this source"
        )


def _detect_format(path: Path) -> Literal["jsonl", "hf_disk", "parquet", "json"]:
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return "jsonl"
        if suffix == ".parquet":
            return "parquet"
        if suffix == ".json":
            return "json"
        raise DataError(f"cannot tell the format of {path} from its suffix; set `format` on this source")
    if any((path / marker).exists() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return "hf_disk"
    if any(path.glob("*.parquet")):
        return "parquet"
    if any(path.glob("*.json")) or any(path.glob("*.jsonl")):
        return "json"
    raise DataError(f"{path} holds no dataset (no save_to_disk files, parquet or json); set `format` or fix `path`")


def _data_files(path: Path, format: str) -> list[Path]:
    if path.is_file():
        return [path]
    patterns = ["*.parquet"] if format == "parquet" else ["*.json", "*.jsonl"]
    files = sorted(p for pattern in patterns for p in path.glob(pattern))
    if not files:
        raise DataError(f"{path} holds no {format} files; fix `path` or `format` of this source")
    return files
