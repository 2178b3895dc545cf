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

Sharded builds (:func:`build_cache_part`): the source's blocks of ``rows_per_task`` rows are split into ``n``
contiguous shards; shard ``i`` is tokenized (by one node, or one job) into the part entry
``cache_dir/<entry>.parts/part-<i>-of-<n>/`` (same files, offsets local to the part, built atomically), and once
every part exists the parts are concatenated into the entry (:func:`assemble_cache`, under the entry's lock) and
removed. Shards hold whole blocks because a tokenize fn may read a block's rows together (the mismatched completions
of unpaired preference rows), so the assembled entry is byte for byte the one an unsharded build writes (its
``meta.json`` differs only in ``build_seconds`` and ``num_proc``, which differ between any two builds).
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import shutil
import socket
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
ROWS_PER_TASK = 512
WAIT_SECONDS = 600.0  # how long a sharded build's reader waits for the parts it does not build
_IN_PROCESS_ROWS = 4096
_COPY_CHUNK = 16 << 20


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
    rows_per_task: int = ROWS_PER_TASK,
    progress: bool = True,
) -> TokenizedCache:
    """Load the entry for (source, fn), tokenizing the source first on a miss.

    Safe to call from several processes at once: one builds under a file lock, the others wait and load. A complete
    set of parts of a sharded build (:func:`build_cache_part`) is assembled instead of tokenizing again.

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
        complete = _complete_count(root, name, parts)
        if complete is not None:
            return _assemble_locked(root, source, fn, complete)
        _remove_stale(root, name)
        started = time.perf_counter()
        with atomic_directory(target) as tmp:
            stats = _tokenize_into(tmp, source, fn, 0, len(source), num_proc, rows_per_task, progress, "")
            meta = _entry_meta(name, parts, source, fn, stats, time.perf_counter() - started)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    return _loaded(target, name)


def shard_rows(num_rows: int, shard: int, num_shards: int, rows_per_task: int = ROWS_PER_TASK) -> tuple[int, int]:
    """The rows ``[start, stop)`` of shard ``shard`` of ``num_shards``: contiguous runs of whole ``rows_per_task``
    blocks (the blocks an unsharded build tokenizes together), as even as blocks allow; a shard may be empty.

    Args:
        num_rows (int): Rows of the source.
        shard (int): Shard index, ``0 <= shard < num_shards``.
        num_shards (int): Number of shards.
        rows_per_task (int): Rows per block.

    Returns:
        tuple[int, int]: First row and one past the last row.
    """
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise DataError(f"shard {shard}/{num_shards}: need at least 1 shard and an index in 0..{num_shards - 1}")
    blocks = -(-num_rows // rows_per_task)
    first, last = shard * blocks // num_shards, (shard + 1) * blocks // num_shards
    return min(first * rows_per_task, num_rows), min(last * rows_per_task, num_rows)


def build_cache_part(
    source: Source,
    fn: TokenizeFn,
    cache_dir: str | Path,
    shard: int,
    num_shards: int,
    num_proc: int | None = None,
    rows_per_task: int = ROWS_PER_TASK,
    progress: bool = True,
) -> TokenizedCache | None:
    """Tokenize shard ``shard`` of ``num_shards`` of the source into its part entry, then assemble the entry if every
    part is there (the builder that finishes last assembles).

    Nothing is built when the entry or this part already exists. Safe to run twice at once (a lock per part).

    Args:
        source (Source): Raw source.
        fn (TokenizeFn): Tokenize function.
        cache_dir (str | Path): Cache root, shared by the builders of every shard.
        shard (int): This builder's shard.
        num_shards (int): Shards of the build (every builder passes the same).
        num_proc (int | None): Worker processes for this shard (as :func:`build_cache`).
        rows_per_task (int): Rows per block (every builder passes the same).
        progress (bool): Show a tqdm progress bar.

    Returns:
        TokenizedCache | None: The entry when it is complete now, else ``None`` (parts of other shards are missing).
    """
    root = Path(cache_dir).expanduser()
    name, parts = cache_key(source, fn)
    entry = _load_entry(root / name, name)
    if entry is not None:
        return entry
    num_rows = len(source)
    start, stop = shard_rows(num_rows, shard, num_shards, rows_per_task)
    part_dir = _parts_dir(root, name) / _part_name(shard, num_shards)
    part_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(part_dir.with_suffix(".lock"))):
            if _part_problem(part_dir, name, parts, shard, num_shards) is not None:
                for stale in part_dir.parent.glob(f".{part_dir.name}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                started = time.perf_counter()
                desc = f" part {shard}/{num_shards}"
                with atomic_directory(part_dir) as tmp:
                    stats = _tokenize_into(tmp, source, fn, start, stop, num_proc, rows_per_task, progress, desc)
                    meta = _entry_meta(name, parts, source, fn, stats, time.perf_counter() - started)
                    meta.update(
                        part=shard, num_parts=num_shards, row_start=start, row_stop=stop,
                        rows_per_task=rows_per_task, host=socket.gethostname(),
                    )  # fmt: skip
                    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    except FileNotFoundError:  # the parts were assembled (and removed) while this builder ran
        entry = _load_entry(root / name, name)
        if entry is None:
            raise
        return entry
    if _part_status(root, name, parts, num_shards)[1]:
        return _load_entry(root / name, name)  # None, unless another builder assembled the parts just now
    return assemble_cache(source, fn, root, num_shards)  # under the lock: once, however many builders end together


def assemble_cache(
    source: Source, fn: TokenizeFn, cache_dir: str | Path, num_shards: int | None = None, hint: str = ""
) -> TokenizedCache:
    """Concatenate the parts of a sharded build into the entry (or load the entry if it is complete already).

    Args:
        source (Source): Raw source.
        fn (TokenizeFn): Tokenize function.
        cache_dir (str | Path): Cache root.
        num_shards (int | None): Shards of the build; ``None``: the one count the parts on disk were built for.
        hint (str): Appended to the error about missing parts (how to build them).

    Returns:
        TokenizedCache: The entry.

    Raises:
        DataError: A part is missing, or was built from another source, tokenizer or tokenize fn.
    """
    root = Path(cache_dir).expanduser()
    name, parts = cache_key(source, fn)
    entry = _load_entry(root / name, name)
    if entry is not None:
        return entry
    if num_shards is None:
        counts = _part_counts(root, name)
        if len(counts) != 1:
            what = "no parts" if not counts else f"parts of {' and of '.join(map(str, counts))} shards"
            raise DataError(f"cache entry {root / name}: {what} in {_parts_dir(root, name)}; {_assemble_hint(hint)}")
        num_shards = counts[0]
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        entry = _load_entry(root / name, name)
        if entry is not None:
            return entry
        _, missing = _part_status(root, name, parts, num_shards)
        if missing:
            raise DataError(_missing_message(root, name, parts, num_shards, missing, hint))
        return _assemble_locked(root, source, fn, num_shards)


def wait_for_cache(
    source: Source,
    fn: TokenizeFn,
    cache_dir: str | Path,
    num_shards: int,
    timeout: float | None = None,
    poll_seconds: float = 1.0,
    hint: str = "",
) -> TokenizedCache:
    """Wait for the entry of a sharded build that other processes (nodes, jobs) build; assemble it once every part is
    there and nobody else has.

    Args:
        source (Source): Raw source.
        fn (TokenizeFn): Tokenize function.
        cache_dir (str | Path): Cache root.
        num_shards (int): Shards of the build.
        timeout (float | None): Seconds to wait for missing parts (default :data:`WAIT_SECONDS`).
        poll_seconds (float): Seconds between looks.
        hint (str): Appended to the time-out message (who builds the missing parts).

    Returns:
        TokenizedCache: The entry.

    Raises:
        DataError: Parts are still missing after ``timeout`` seconds (the message names them).
    """
    root = Path(cache_dir).expanduser()
    name, parts = cache_key(source, fn)
    deadline = time.monotonic() + (WAIT_SECONDS if timeout is None else timeout)
    while True:
        entry = _load_entry(root / name, name)
        if entry is not None:
            return entry
        _, missing = _part_status(root, name, parts, num_shards)
        if not missing:
            return assemble_cache(source, fn, root, num_shards, hint)
        if time.monotonic() >= deadline:
            waited = WAIT_SECONDS if timeout is None else timeout
            raise DataError(_missing_message(root, name, parts, num_shards, missing, hint, waited))
        time.sleep(poll_seconds)


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


def _tokenize_into(
    tmp: Path,
    source: Source,
    fn: TokenizeFn,
    start: int,
    stop: int,
    num_proc: int | None,
    rows_per_task: int,
    progress: bool,
    desc: str,
) -> dict[str, int]:
    """Tokenize rows ``[start, stop)`` (``start`` on the block grid) into the data files of ``tmp``."""
    tasks = [(s, min(s + rows_per_task, stop)) for s in range(start, stop, rows_per_task)]
    if num_proc is None:
        num_proc = 1 if stop - start <= _IN_PROCESS_ROWS else min(os.cpu_count() or 1, 8)
    num_proc = max(1, min(num_proc, len(tasks) or 1))
    lengths: list[np.ndarray] = []
    row_ids: list[np.ndarray] = []
    tags: list[np.ndarray] = []
    bar = tqdm(total=stop - start, desc=f"tokenizing {source.path.name}{desc}", unit="rows", disable=not progress)
    try:
        with (tmp / "input_ids.bin").open("wb") as f_ids, (tmp / "loss_mask.bin").open("wb") as f_mask:
            for (first, last), (ids, mask, lens, rows, tag) in zip(tasks, _run_tasks(tasks, source, fn, num_proc)):
                f_ids.write(ids.tobytes())
                f_mask.write(mask.tobytes())
                lengths.append(lens)
                row_ids.append(rows)
                tags.append(tag)
                bar.update(last - first)
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
    stats = {"num_rows": stop - start, "num_samples": len(all_lengths), "num_tokens": int(offsets[-1])}
    stats["num_proc"] = num_proc
    if offsets[-1]:
        mask = np.memmap(tmp / "loss_mask.bin", dtype=np.uint8, mode="r")
        stats["num_supervised"] = int(mask.sum(dtype=np.int64))
    return stats


def _entry_meta(
    name: str, parts: dict[str, str], source: Source, fn: TokenizeFn, stats: dict[str, int], seconds: float
) -> dict[str, Any]:
    """The ``meta.json`` of an entry (or of a part, which adds its shard fields), keys in a fixed order."""
    meta = {
        "version": CACHE_VERSION,
        "name": name,
        "key": parts,
        "source_path": str(source.path),
        "tokenize_fn": type(fn).__qualname__,
        "tokenize_config": fn.config(),
        "num_rows": stats["num_rows"],
        "num_samples": stats["num_samples"],
        "num_tokens": stats["num_tokens"],
        "build_seconds": round(seconds, 3),
        "num_proc": stats["num_proc"],
    }
    if stats["num_tokens"]:
        meta["num_supervised"] = stats["num_supervised"]
    return json.loads(json.dumps(meta, default=str))  # as read back: the parts' and the entry's compare equal


def _assemble_locked(root: Path, source: Source, fn: TokenizeFn, num_shards: int) -> TokenizedCache:
    """Concatenate the (complete) parts into the entry and remove them; the caller holds the entry's lock."""
    started = time.perf_counter()
    name, parts = cache_key(source, fn)
    target = root / name
    found, missing = _part_status(root, name, parts, num_shards)
    if missing:
        raise DataError(_missing_message(root, name, parts, num_shards, missing, ""))
    metas = [found[i][1] for i in range(num_shards)]
    dirs = [found[i][0] for i in range(num_shards)]
    num_rows = len(source)
    expected = [shard_rows(num_rows, i, num_shards, metas[0]["rows_per_task"]) for i in range(num_shards)]
    for part_dir, meta, rows in zip(dirs, metas, expected):
        if (meta["row_start"], meta["row_stop"]) != rows:
            raise DataError(
                f"{part_dir} holds rows {meta['row_start']}..{meta['row_stop']} of the source, but its shard is rows "
                f"{rows[0]}..{rows[1]} (another rows_per_task or another row count): delete it and build it again"
            )
    _remove_stale(root, name)
    with atomic_directory(target) as tmp:
        for file_name in ("input_ids.bin", "loss_mask.bin"):
            with (tmp / file_name).open("wb") as out:
                for part_dir in dirs:
                    with (part_dir / file_name).open("rb") as f:
                        shutil.copyfileobj(f, out, _COPY_CHUNK)
        offsets = [np.load(d / "offsets.npy") for d in dirs]
        bases = np.cumsum([0] + [int(o[-1]) for o in offsets])
        np.save(
            tmp / "offsets.npy", np.concatenate([np.zeros(1, np.int64)] + [o[1:] + b for o, b in zip(offsets, bases)])
        )
        np.save(tmp / "rows.npy", np.concatenate([np.load(d / "rows.npy") for d in dirs]))
        if fn.tagged:
            np.save(tmp / "tags.npy", np.concatenate([np.load(d / "tags.npy") for d in dirs]))
        stats = {
            "num_rows": num_rows,
            "num_samples": sum(m["num_samples"] for m in metas),
            "num_tokens": int(bases[-1]),
            "num_proc": sum(m["num_proc"] for m in metas),
            "num_supervised": sum(m.get("num_supervised", 0) for m in metas),
        }
        seconds = max(m["build_seconds"] for m in metas) + time.perf_counter() - started
        (tmp / "meta.json").write_text(json.dumps(_entry_meta(name, parts, source, fn, stats, seconds), indent=1))
    entry = _loaded(target, name)
    shutil.rmtree(_parts_dir(root, name), ignore_errors=True)
    return entry


def _parts_dir(root: Path, name: str) -> Path:
    return root / f"{name}.parts"


def _part_name(shard: int, num_shards: int) -> str:
    return f"part-{shard:05d}-of-{num_shards:05d}"


def _part_counts(root: Path, name: str) -> list[int]:
    """The shard counts that parts on disk were built for."""
    counts = set()
    for path in _parts_dir(root, name).glob("part-*-of-*"):
        if path.is_dir() and path.name.rsplit("-", 1)[-1].isdigit():
            counts.add(int(path.name.rsplit("-", 1)[-1]))
    return sorted(counts)


def _complete_count(root: Path, name: str, parts: dict[str, str]) -> int | None:
    """The shard count of a complete set of valid parts on disk, if there is one."""
    for num_shards in _part_counts(root, name):
        try:
            if not _part_status(root, name, parts, num_shards)[1]:
                return num_shards
        except DataError:  # a foreign part: not a set to assemble
            continue
    return None


def _part_status(
    root: Path, name: str, parts: dict[str, str], num_shards: int
) -> tuple[dict[int, tuple[Path, dict]], list[int]]:
    """The complete parts (shard -> folder and meta) of a build in ``num_shards`` shards, and the missing shards.

    Raises:
        DataError: A part was built for another entry (another source, tokenizer or tokenize fn).
    """
    found, missing = {}, []
    for shard in range(num_shards):
        part_dir = _parts_dir(root, name) / _part_name(shard, num_shards)
        problem = _part_problem(part_dir, name, parts, shard, num_shards)
        if problem is None:
            found[shard] = (part_dir, json.loads((part_dir / "meta.json").read_text()))
        elif problem == "":
            missing.append(shard)
        else:
            raise DataError(problem)
    return found, missing


def _part_problem(part_dir: Path, name: str, parts: dict[str, str], shard: int, num_shards: int) -> str | None:
    """``None`` for a complete part of this entry, ``""`` for a missing or incomplete one, else what is wrong."""
    try:
        meta = json.loads((part_dir / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    if meta.get("version") != CACHE_VERSION:
        return ""
    if meta.get("name") != name:
        return (
            f"{part_dir} was built for cache entry {meta.get('name')}, not {name} (its {_key_diff(meta, parts)} "
            f"differs): delete it and build shard {shard}/{num_shards} again"
        )
    if (meta.get("part"), meta.get("num_parts")) != (shard, num_shards):
        return f"{part_dir} holds shard {meta.get('part')}/{meta.get('num_parts')}: delete it and build it again"
    sizes = {"input_ids.bin": 4 * meta["num_tokens"], "loss_mask.bin": meta["num_tokens"]}
    try:
        if any((part_dir / f).stat().st_size != size for f, size in sizes.items()):
            return ""
    except OSError:
        return ""
    return None


def _key_diff(meta: dict[str, Any], parts: dict[str, str]) -> str:
    """Which key parts (source content, tokenizer, tokenize fn) a part's meta differs in from ``parts``."""
    theirs = meta.get("key") or {}
    names = {"source": "source content", "tokenizer": "tokenizer", "tokenize_fn": "tokenize fn", "version": "version"}
    differ = [names.get(k, k) for k in parts if parts[k] != theirs.get(k)]
    return " and ".join(differ) or "key"


def _missing_message(
    root: Path,
    name: str,
    parts: dict[str, str],
    num_shards: int,
    missing: list[int],
    hint: str,
    waited: float | None = None,
) -> str:
    shards = ", ".join(f"{i}/{num_shards}" for i in missing)
    after = f" after waiting {waited:.0f} s" if waited is not None else ""
    message = f"cache entry {root / name} is incomplete{after}: part(s) {shards} missing in {_parts_dir(root, name)}"
    others = _other_keys(root, name, parts, num_shards, missing)
    if others:
        message += f"; {others}"
    return message + (f"; {hint}" if hint else "")


def _other_keys(root: Path, name: str, parts: dict[str, str], num_shards: int, missing: list[int]) -> str:
    """The missing parts found under another key of the same source stem, and what differs (a changed source file,
    another tokenizer or tokenize fn between the builders)."""
    stem = name.rsplit("-", 1)[0]
    notes = []
    for other in sorted(root.glob(f"{stem}-*.parts")):
        if other.name == f"{name}.parts":
            continue
        shards = [i for i in missing if (other / _part_name(i, num_shards) / "meta.json").is_file()]
        if shards:
            meta = json.loads((other / _part_name(shards[0], num_shards) / "meta.json").read_text())
            which = ", ".join(f"{i}/{num_shards}" for i in shards)
            notes.append(f"part(s) {which} exist in {other.name}, built with another {_key_diff(meta, parts)}")
    return "; ".join(notes)


def _assemble_hint(hint: str) -> str:
    return hint or "build the shards first (build_cache_part, or xtl build-cache --shard i/n)"


def _remove_stale(root: Path, name: str) -> None:
    for stale in root.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _loaded(target: Path, name: str) -> TokenizedCache:
    entry = _load_entry(target, name)
    if entry is None:
        raise DataError(f"cache entry {target} is incomplete right after building it; is the disk full?")
    return entry


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
