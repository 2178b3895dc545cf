"""Tokenization cache: flat memory-mapped token ids and loss mask, plus per-sample offsets.

Layout of one entry (``cache_dir/<source stem>-<key>/``)::

    meta.json        key parts, counts, dtypes (written last; its presence marks a complete entry)
    input_ids.bin    int32, all samples back to back
    loss_mask.bin    uint8, 1 where the token is a training target (labels == input_ids), else 0
    offsets.npy      int64 (num_samples + 1,), sample i is [offsets[i], offsets[i+1])
    rows.npy         int64 (num_samples,), the source row each sample came from
    tags.npy         int8 or float32 (num_samples,), a tag per sample (only from a tokenize fn whose ``tagged``
                     is true: the label of an unpaired preference row, the margin of a preference pair)

The key hashes (source content, tokenizer, tokenize-fn code and arguments). An entry is built in a temporary
folder and renamed into place; a ``filelock`` lock makes concurrent builders (ranks, runs) build it once.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from filelock import FileLock
from tqdm import tqdm

from xtl.data.item import IGNORE_INDEX, DataError, DataItem
from xtl.data.sources import Source
from xtl.data.tokenize import TokenizeFn, tokenizer_fingerprint
from xtl.utils import atomic_directory

CACHE_VERSION = 1
DEFAULT_CACHE_DIR = Path("~/.cache/xtl/tokenized")
_IN_PROCESS_ROWS = 4096


@dataclass
class TokenizedCache:
    """A loaded cache entry; token access is a slice of memory-mapped arrays, never re-tokenization."""

    directory: Path
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    meta: dict[str, Any]
    tags: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getstate__(self) -> dict[str, Any]:
        # Pickled by path (a spawned loader worker maps the files again) instead of copying every token.
        return {"directory": str(self.directory), "name": self.meta.get("name", self.directory.name)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        entry = _load_entry(Path(state["directory"]), state["name"])
        if entry is None:
            raise DataError(f"cache entry {state['directory']} disappeared or is incomplete; rebuild it")
        self.__dict__.update(entry.__dict__)

    @property
    def num_tokens(self) -> np.ndarray:
        """Tokens per sample, int64."""
        return np.diff(self.offsets)

    def tokens(self, index: int, start: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Ids and (unshifted) labels of sample ``index``, optionally a ``[start, end)`` slice of it.

        Args:
            index (int): Sample index.
            start (int): First token within the sample.
            end (int | None): One past the last token within the sample.

        Returns:
            tuple[np.ndarray, np.ndarray]: int64 ids and labels (-100 where no loss).
        """
        base = int(self.offsets[index])
        stop = int(self.offsets[index + 1]) if end is None else base + end
        ids = np.asarray(self.input_ids[base + start : stop], dtype=np.int64)
        mask = np.asarray(self.loss_mask[base + start : stop], dtype=bool)
        return ids, np.where(mask, ids, IGNORE_INDEX)

    def item(self, index: int) -> DataItem:
        """Sample ``index`` as a ``DataItem``.

        Args:
            index (int): Sample index.

        Returns:
            DataItem: Ids, labels, token count.
        """
        ids, labels = self.tokens(index)
        return {"input_ids": ids.tolist(), "labels": labels.tolist(), "num_tokens": len(ids)}


def cache_key(source: Source, fn: TokenizeFn) -> tuple[str, dict[str, str]]:
    """The cache key of (source, tokenize fn) and its parts.

    Args:
        source (Source): Raw source.
        fn (TokenizeFn): Tokenize function (holds the tokenizer).

    Returns:
        tuple[str, dict[str, str]]: Entry folder name and the hashes it combines.
    """
    parts = {
        "version": str(CACHE_VERSION),
        "source": source.fingerprint(),
        "tokenizer": tokenizer_fingerprint(fn.tokenizer),
        "tokenize_fn": fn.fingerprint(),
    }
    digest = xxhash.xxh3_128(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return f"{source.path.stem}-{digest}", parts


def load_cache(cache_dir: str | Path, source: Source, fn: TokenizeFn) -> TokenizedCache | None:
    """Load the entry for (source, fn) if a complete one exists.

    Args:
        cache_dir (str | Path): Cache root.
        source (Source): Raw source.
        fn (TokenizeFn): Tokenize function.

    Returns:
        TokenizedCache | None: The entry, or ``None`` on a miss.
    """
    name, _ = cache_key(source, fn)
    return _load_entry(Path(cache_dir).expanduser() / name, name)


def build_cache(
    source: Source,
    fn: TokenizeFn,
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    num_proc: int | None = None,
    rows_per_task: int = 512,
    progress: bool = True,
) -> TokenizedCache:
    """Load the entry for (source, fn), tokenizing the source first on a miss.

    Safe to call from several processes at once: one builds under a file lock, the others wait and load.

    Args:
        source (Source): Raw source.
        fn (TokenizeFn): Tokenize function.
        cache_dir (str | Path): Cache root.
        num_proc (int | None): Worker processes; ``None`` picks ``min(cpu count, 8)`` (1 for small sources).
        rows_per_task (int): Rows tokenized per worker task.
        progress (bool): Show a tqdm progress bar.

    Returns:
        TokenizedCache: The loaded entry.
    """
    root = Path(cache_dir).expanduser()
    name, parts = cache_key(source, fn)
    target = root / name
    entry = _load_entry(target, name)
    if entry is not None:
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        entry = _load_entry(target, name)
        if entry is not None:
            return entry
        for stale in root.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        with atomic_directory(target) as tmp:
            _build_into(tmp, source, fn, name, parts, num_proc, rows_per_task, progress)
    entry = _load_entry(target, name)
    if entry is None:
        raise DataError(f"cache entry {target} is incomplete right after building it; is the disk full?")
    return entry


# ---------------------------------------------------------------------------------------------------------------
# private helpers

_WORKER: tuple[Source, TokenizeFn] | None = None


def _init_worker(source: Source, fn: TokenizeFn) -> None:
    global _WORKER
    _WORKER = (source, fn)


def _tokenize_range(bounds: tuple[int, int]) -> tuple[np.ndarray, ...]:
    assert _WORKER is not None
    source, fn = _WORKER
    start, stop = bounds
    rows = source.rows(start, stop)
    results = fn.batch_arrays(rows, lambda i: source.location(start + i))
    lengths, row_ids, id_chunks, mask_chunks, tags = [], [], [], [], []
    for i, samples in enumerate(results):
        for ids, mask, *tag in samples:
            if len(ids) == 0:
                continue
            if len(mask) != len(ids):
                raise DataError(f"{source.location(start + i)}: tokenize fn returned a loss mask of another length")
            lengths.append(len(ids))
            row_ids.append(start + i)
            id_chunks.append(ids)
            mask_chunks.append(mask)
            tags.append(tag[0] if tag else 0)
    flat_ids = np.concatenate(id_chunks) if id_chunks else np.zeros(0, dtype=np.int64)
    if len(flat_ids) and (flat_ids.min() < 0 or flat_ids.max() >= 2**31):
        raise DataError(f"tokenize fn for {source.path} returned token ids outside int32")
    return (
        flat_ids.astype(np.int32),
        (np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, dtype=bool)).astype(np.uint8),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(row_ids, dtype=np.int64),
        np.asarray(tags, dtype=fn.tag_dtype),
    )


def _build_into(
    tmp: Path,
    source: Source,
    fn: TokenizeFn,
    name: str,
    parts: dict[str, str],
    num_proc: int | None,
    rows_per_task: int,
    progress: bool,
) -> None:
    started = time.perf_counter()
    num_rows = len(source)
    tasks = [(s, min(s + rows_per_task, num_rows)) for s in range(0, num_rows, rows_per_task)]
    if num_proc is None:
        num_proc = 1 if num_rows <= _IN_PROCESS_ROWS else min(os.cpu_count() or 1, 8)
    num_proc = max(1, min(num_proc, len(tasks) or 1))
    lengths: list[np.ndarray] = []
    row_ids: list[np.ndarray] = []
    tags: list[np.ndarray] = []
    bar = tqdm(total=num_rows, desc=f"tokenizing {source.path.name}", unit="rows", disable=not progress)
    try:
        with (tmp / "input_ids.bin").open("wb") as f_ids, (tmp / "loss_mask.bin").open("wb") as f_mask:
            for (start, stop), (ids, mask, lens, rows, tag) in zip(tasks, _run_tasks(tasks, source, fn, num_proc)):
                f_ids.write(ids.tobytes())
                f_mask.write(mask.tobytes())
                lengths.append(lens)
                row_ids.append(rows)
                tags.append(tag)
                bar.update(stop - start)
    except BaseException:
        bar.leave = False  # the error is the message: the half bar is cleared, and not drawn again at exit
        raise
    finally:
        bar.close()
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(len(all_lengths) + 1, dtype=np.int64)
    np.cumsum(all_lengths, out=offsets[1:])
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "rows.npy", np.concatenate(row_ids) if row_ids else np.zeros(0, dtype=np.int64))
    if fn.tagged:
        np.save(tmp / "tags.npy", np.concatenate(tags) if tags else np.zeros(0, dtype=np.int8))
    meta = {
        "version": CACHE_VERSION,
        "name": name,
        "key": parts,
        "source_path": str(source.path),
        "tokenize_fn": type(fn).__qualname__,
        "tokenize_config": fn.config(),
        "num_rows": num_rows,
        "num_samples": len(all_lengths),
        "num_tokens": int(offsets[-1]),
        "build_seconds": round(time.perf_counter() - started, 3),
        "num_proc": num_proc,
    }
    if offsets[-1]:
        meta["num_supervised"] = int(np.memmap(tmp / "loss_mask.bin", dtype=np.uint8, mode="r").sum(dtype=np.int64))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))


def _run_tasks(tasks: list[tuple[int, int]], source: Source, fn: TokenizeFn, num_proc: int):
    if num_proc <= 1:
        _init_worker(source, fn)
        try:
            for task in tasks:
                yield _tokenize_range(task)
        finally:
            _init_worker(None, None)  # type: ignore[arg-type]
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    if method == "fork":
        # Collect the parent's garbage before forking: a forked worker that collects an object whose native threads
        # stayed in the parent (e.g. a dropped gloo process group) can block forever in its destructor.
        gc.collect()
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # each worker is one process; no Rust thread pool inside
    try:
        context = mp.get_context(method)
        pool = ProcessPoolExecutor(num_proc, mp_context=context, initializer=_init_worker, initargs=(source, fn))
        results = pool.map(_tokenize_range, tasks)  # submits every task: the workers start now, with the setting
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    try:
        yield from results
    finally:  # a task's error: the queued tasks are dropped, the running ones end (``Pool.terminate`` could hang)
        pool.shutdown(wait=True, cancel_futures=True)


def _load_entry(target: Path, name: str) -> TokenizedCache | None:
    meta_path = target / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("version") != CACHE_VERSION or meta.get("name") != name:
        return None
    n_tokens = int(meta["num_tokens"])
    try:
        if (target / "input_ids.bin").stat().st_size != 4 * n_tokens:
            return None
        if (target / "loss_mask.bin").stat().st_size != n_tokens:
            return None
        offsets = np.load(target / "offsets.npy", mmap_mode="r")
        rows = np.load(target / "rows.npy", mmap_mode="r")
        tags = np.load(target / "tags.npy") if (target / "tags.npy").is_file() else None
    except (OSError, ValueError):
        return None
    if len(offsets) != int(meta["num_samples"]) + 1 or int(offsets[-1]) != n_tokens:
        return None
    if tags is not None and len(tags) != int(meta["num_samples"]):
        return None
    if n_tokens:
        ids = np.memmap(target / "input_ids.bin", dtype=np.int32, mode="r", shape=(n_tokens,))
        mask = np.memmap(target / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(n_tokens,))
    else:
        ids, mask = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint8)
    return TokenizedCache(target, ids, mask, np.asarray(offsets), np.asarray(rows), meta, tags)
