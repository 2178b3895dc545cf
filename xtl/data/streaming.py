"""Streaming training data: rows tokenized on the fly, packed window by window, one rank's steps, exact resume.

Each data-parallel rank reads its share of the streaming sources (:mod:`xtl.data.streaming_source`), cuts its mixed
row stream into *windows* of ``window`` rows (a window also ends with the pass of any of its sources), tokenizes a
window with the tokenize functions of the cached path (in ``workers`` processes, results taken in submission
order) and packs it as the cached path packs a whole set:

- window ``j`` of rank ``r`` of ``w`` is window ``g = j * w + r``; it is packed by
  :func:`~xtl.data.packing.best_fit_pack` or :func:`~xtl.data.packing.hard_pack` with seed ``seed + g`` and its packs
  are taken in the order ``default_rng([seed + g, 0]).permutation(num_packs)`` (the cached path's epoch-0 order
  with that seed), none dropped;
- so a window of rank 0 holding the whole corpus gives the packs of the cached path, in its order (the cached
  path drops the tail that does not fill a step; the stream goes on with the next pass).

A rank's position is :class:`StreamPosition`: the window it is in (its index and where its rows start) and the packs
of it already handed out. Resuming there reads the rows of that window again (skipping raw rows of one shard per
source) and tokenizes one window: never the consumed prefix.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
import xxhash

from xtl.data.cache import TokenizedCache
from xtl.data.collate import MicroBatch, StepCollator
from xtl.data.dataset import MixedDataset
from xtl.data.item import DataError
from xtl.data.packing import OverlongPolicy, Pack, PackedDataset, best_fit_pack, hard_pack
from xtl.data.sources import parse_jsonl_row
from xtl.data.streaming_source import (
    Row,
    SourceReader,
    StreamCursor,
    StreamSource,
    mix_choices,
)
from xtl.data.tokenize import TokenizeFn

log = logging.getLogger(__name__)
STREAM_PACKING = ("best_fit", "hard")
NOMINAL_STEPS = 2**62  # the loader's length: Lightning then fetches no batch ahead (the stream itself is endless)


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's pack stream stands: ``packs`` packs of window ``window`` handed out, the window's rows starting
    at ``cursor`` of the row stream."""

    window: int
    packs: int
    cursor: StreamCursor

    @classmethod
    def start(cls, num_sources: int) -> StreamPosition:
        """The beginning of a stream."""
        return cls(0, 0, StreamCursor.start(num_sources))

    def to_list(self) -> list[Any]:
        """Plain ints for a checkpoint: ``[window, packs, cursor]``."""
        return [self.window, self.packs, self.cursor.to_list()]

    @classmethod
    def from_list(cls, value: Sequence[Any]) -> StreamPosition:
        """Inverse of :meth:`to_list`."""
        return cls(int(value[0]), int(value[1]), StreamCursor.from_list(value[2]))


@dataclass
class Window:
    """The rows of one window (source index, row, location) and the row-stream positions of its start and end."""

    index: int
    rows: list[tuple[int, Row, str]]
    start: StreamCursor
    end: StreamCursor


class StreamingPacks:
    """The endless pack stream of one data-parallel rank.

    Args:
        sources (list[StreamSource]): Streaming sources, mixed by their weights.
        tokenize_fns (list[TokenizeFn]): The tokenize function of every source (those of the cached path).
        pack_max_length (int): Tokens per pack.
        packing (str): ``best_fit`` or ``hard``.
        overlong (str): ``best_fit``: samples longer than a pack are truncated, dropped or an error.
        seed (int): Seed of shard orders, mixing, packing and pack order.
        rank (int): Data-parallel rank.
        world_size (int): Data-parallel ranks.
        window (int): Rows per window (the packing buffer).
        workers (int): Tokenize processes (0: in this process).
        rows_per_task (int): Rows per tokenize task.
        prefetch (int): Windows read and tokenized ahead (with workers).
    """

    def __init__(
        self,
        sources: list[StreamSource],
        tokenize_fns: list[TokenizeFn],
        pack_max_length: int,
        packing: str = "best_fit",
        overlong: OverlongPolicy = "truncate",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        window: int = 4096,
        workers: int = 0,
        rows_per_task: int = 256,
        prefetch: int = 1,
    ) -> None:
        if packing not in STREAM_PACKING:
            raise DataError(f"data.packing: {packing!r} cannot stream; a streaming run packs best_fit or hard")
        if window < 1:
            raise DataError(f"data.stream_window must be >= 1 row, got {window}")
        if len(tokenize_fns) != len(sources) or not sources:
            raise DataError(f"{len(sources)} streaming sources but {len(tokenize_fns)} tokenize functions")
        self.sources = sources
        self.tokenize_fns = tokenize_fns
        self.pack_max_length = pack_max_length
        self.packing = packing
        self.overlong = overlong
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.window = window
        self.workers = max(0, int(workers))
        self.rows_per_task = rows_per_task
        self.prefetch = max(1, prefetch)
        self.rows_tokenized = 0  # rows sent to tokenization by this object (resume cost, for tests and logs)
        self._pool: ProcessPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None

    def packs(self, position: StreamPosition) -> Iterator[tuple[Pack, StreamPosition]]:
        """The packs from ``position`` on, each with the position after it.

        Args:
            position (StreamPosition): Where to start.

        Yields:
            tuple[Pack, StreamPosition]: A pack (``index``: its place in its window's plan) and the position of the
            next one.
        """
        windows = self.windows(position.cursor, position.window)
        pending: deque[tuple[Window, list[tuple[list[int], Any]]]] = deque()
        skip = position.packs
        try:
            while True:
                while len(pending) < (1 + self.prefetch if self.workers else 1):
                    window = next(windows)
                    pending.append((window, self._submit(window)))
                window, tasks = pending.popleft()
                packs, order = self.pack_window(window, self._collect(window, tasks))
                for t in range(skip, len(order)):
                    if t + 1 < len(order):
                        after = StreamPosition(window.index, t + 1, window.start)
                    else:  # the last pack: the next one is the first of the next window
                        after = StreamPosition(window.index + 1, 0, window.end)
                    yield packs[int(order[t])], after
                skip = 0
        finally:
            windows.close()
            for _, tasks in pending:
                for _, result in tasks:
                    if isinstance(result, Future):
                        result.cancel()

    def windows(self, cursor: StreamCursor, index: int = 0) -> Iterator[Window]:
        """This rank's windows of rows from ``cursor`` on (``index``: the number of the first).

        Yields:
            Window: ``window`` rows, fewer when a source's pass ends inside it.
        """
        weights = [s.weight for s in self.sources]
        readers: list[SourceReader | None] = [None] * len(self.sources)
        cursors = list(cursor.sources)
        draws = cursor.draws
        try:
            while True:
                start = StreamCursor(draws, tuple(cursors))
                rows: list[tuple[int, Row, str]] = []
                for k in mix_choices(weights, self.seed, self.rank, draws, self.window).tolist():
                    reader = readers[k]
                    if reader is None:
                        reader = readers[k] = SourceReader(
                            self.sources[k], k, self.seed, self.rank, self.world_size, cursors[k]
                        )
                    row, location, ended = reader.next()
                    cursors[k] = reader.cursor
                    draws += 1
                    rows.append((k, row, location))
                    if ended:
                        break
                yield Window(index, rows, start, StreamCursor(draws, tuple(cursors)))
                index += 1
        finally:
            for reader in readers:
                if reader is not None:
                    reader.close()

    def tokenize(self, window: Window) -> list[tuple[np.ndarray, np.ndarray]]:
        """The samples of a window's rows, in row order, as the cache stores them (int32 ids, uint8 loss mask).

        Args:
            window (Window): The window.

        Returns:
            list[tuple[np.ndarray, np.ndarray]]: Ids and loss mask of every sample.
        """
        return self._collect(window, self._submit(window))

    def pack_window(
        self, window: Window, samples: list[tuple[np.ndarray, np.ndarray]]
    ) -> tuple[PackedDataset, np.ndarray]:
        """Pack the tokenized samples of a window (in row order) as the cached path packs a set.

        Args:
            window (Window): The window.
            samples (list[tuple[np.ndarray, np.ndarray]]): Its samples: int32 ids and uint8 loss mask.

        Returns:
            tuple[PackedDataset, np.ndarray]: Its packs and the order they are taken in.
        """
        seed = self.seed + window.index * self.world_size + self.rank
        lengths = np.asarray([len(ids) for ids, _ in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.concatenate([s[0] for s in samples]) if samples else np.zeros(0, dtype=np.int32)
        mask = np.concatenate([s[1] for s in samples]) if samples else np.zeros(0, dtype=np.uint8)
        cache = TokenizedCache(Path(f"stream-window-{window.index}"), ids, mask, offsets, np.arange(len(samples)), {})
        data = MixedDataset([cache], [1.0], seed, ["stream"])
        if self.packing == "hard":
            plan = hard_pack(data.num_tokens, self.pack_max_length, seed)
        else:
            try:
                plan = best_fit_pack(data.num_tokens, self.pack_max_length, seed, self.overlong)
            except DataError as err:
                raise DataError(f"streaming window {window.index} (from {window.rows[0][2]}): {err}") from None
        order = np.random.default_rng([seed, 0]).permutation(len(plan))
        return PackedDataset(data, plan), order

    def close(self) -> None:
        """Stop the tokenize processes."""
        if self._finalizer is not None:
            self._finalizer()
        self._pool = self._finalizer = None

    def _submit(self, window: Window) -> list[tuple[list[int], Any]]:
        """Tokenize tasks of a window: rows grouped by source, ``rows_per_task`` at a time (results in order)."""
        tasks = []
        for k in range(len(self.sources)):
            where = [i for i, (source, _, _) in enumerate(window.rows) if source == k]
            for a in range(0, len(where), self.rows_per_task):
                chunk = where[a : a + self.rows_per_task]
                task = (k, [window.rows[i][1] for i in chunk], [window.rows[i][2] for i in chunk])
                tasks.append((chunk, task))
        self.rows_tokenized += len(window.rows)
        if not self.workers:
            return [(chunk, _tokenize_with(self.tokenize_fns, task)) for chunk, task in tasks]
        pool = self._executor()
        return [(chunk, pool.submit(_tokenize_task, task)) for chunk, task in tasks]

    def _collect(self, window: Window, tasks: list[tuple[list[int], Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
        per_row: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in window.rows]
        for chunk, result in tasks:  # in submission order: the same samples whatever the workers' timing
            for i, samples in zip(chunk, result.result() if isinstance(result, Future) else result):
                per_row[i] = samples
        return [s for samples in per_row for s in samples]

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            if method == "fork":
                gc.collect()  # as the cache builder: no foreign native threads' objects collected in a child
            previous = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            try:
                self._pool = ProcessPoolExecutor(
                    self.workers,
                    mp_context=mp.get_context(method),
                    initializer=_init_worker,
                    initargs=(self.tokenize_fns,),
                )
            finally:
                if previous is None:
                    os.environ.pop("TOKENIZERS_PARALLELISM", None)
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = previous
            self._finalizer = weakref.finalize(self, _shutdown, self._pool)
        return self._pool


class StreamingLoader:
    """One rank's training steps from a :class:`StreamingPacks` stream: lists of ``micro_batches_per_step``
    micro-batches, endless (the run ends at ``trainer.max_steps``).

    The resume state (:meth:`state_dict`) is ``consumed_samples`` (packs of all ranks, as the cached path's) plus the
    position of every rank, gathered from all processes when a process group is up (Lightning calls ``state_dict``
    on every rank when it checkpoints, and writes rank 0's). Without a rank's position (a state saved without a
    process group, or by the data module alone) that rank replays its stream up to ``consumed_samples``: the same
    packs, at the cost of tokenizing the consumed prefix again.

    Args:
        packs (StreamingPacks): This rank's pack stream.
        collate_fn (StepCollator): Packs to micro-batches (the cached path's).
        micro_batches_per_step (int): Packs per rank per step.
        settings (dict): What the stream depends on (checked when a state is loaded).
        consumed_samples (int): Packs consumed by all ranks (resume).
        position (StreamPosition | None): This rank's position at ``consumed_samples`` (``None``: replay).
        pin_memory (bool): Pin every micro-batch (for asynchronous copies to the GPU).
    """

    def __init__(
        self,
        packs: StreamingPacks,
        collate_fn: StepCollator,
        micro_batches_per_step: int,
        settings: dict[str, Any],
        consumed_samples: int = 0,
        position: StreamPosition | None = None,
        pin_memory: bool = False,
    ) -> None:
        if micro_batches_per_step < 1:
            raise DataError(f"micro_batches_per_step must be >= 1, got {micro_batches_per_step}")
        self.packs = packs
        self.collate_fn = collate_fn
        self.micro_batches = micro_batches_per_step
        self.rank = packs.rank
        self.world_size = packs.world_size
        self.global_batch = self.world_size * micro_batches_per_step
        self.settings = settings
        self.pin_memory = pin_memory
        self._consumed = 0
        self._position: StreamPosition | None = None
        self.seek(consumed_samples, position)

    def __len__(self) -> int:
        return NOMINAL_STEPS

    @property
    def consumed_samples(self) -> int:
        """Packs consumed by all ranks so far."""
        return self._consumed

    @property
    def position(self) -> StreamPosition | None:
        """This rank's position after the last step handed out (``None`` until a replay finds it)."""
        return self._position

    def seek(self, consumed_samples: int, position: StreamPosition | None = None) -> None:
        """Continue after ``consumed_samples`` packs of all ranks, at ``position`` when this rank's is known.

        Raises:
            DataError: ``consumed_samples`` is not a whole number of steps.
        """
        if consumed_samples % self.global_batch:
            raise DataError(
                f"consumed_samples {consumed_samples} is not a multiple of the global batch {self.global_batch} "
                f"(world size {self.world_size} x micro_batches_per_step {self.micro_batches})"
            )
        if consumed_samples == 0 and position is None:
            position = StreamPosition.start(len(self.packs.sources))
        self._consumed, self._position = int(consumed_samples), position

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        start, skip = self._position, 0
        if start is None:
            start, skip = StreamPosition.start(len(self.packs.sources)), self._consumed // self.world_size
            log.warning(
                "xtl data: no stream position for rank %d in the data state: replaying its first %d packs (the "
                "consumed prefix is tokenized again)",
                self.rank,
                skip,
            )
        stream = self.packs.packs(start)
        try:
            after = start
            for _ in range(skip):
                _, after = next(stream)
            self._position = after
            while True:
                taken = [next(stream) for _ in range(self.micro_batches)]
                batch = self.collate_fn([pack for pack, _ in taken])
                if self.pin_memory:
                    batch = [mb.pin_memory() for mb in batch]
                self._position = taken[-1][1]
                self._consumed += self.global_batch
                yield batch
        finally:
            stream.close()

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """Resume state: ``consumed_samples``, the settings it refers to and every rank's position.

        Every process of a process group must call it together (it gathers the positions), as Lightning does.

        Args:
            gather (bool): Gather the positions of all processes (``False``: this rank's only, no collective).

        Returns:
            dict: ``consumed_samples``, ``seed``, ``world_size``, ``micro_batches_per_step``, ``streaming``
            (the settings) and ``positions`` (data-parallel rank as a string -> ``[window, packs, cursor]``).
        """
        mine = (self.rank, None if self._position is None else self._position.to_list())
        entries = [mine]
        if gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            entries = [None] * dist.get_world_size()
            dist.all_gather_object(entries, mine)
        positions = {str(rank): position for rank, position in entries if position is not None}  # type: ignore[misc]
        return {
            "consumed_samples": self._consumed,
            "seed": self.packs.seed,
            "world_size": self.world_size,
            "micro_batches_per_step": self.micro_batches,
            "streaming": self.settings,
            "positions": positions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state of :meth:`state_dict`.

        Raises:
            DataError: The state is of a cached run, or of a stream with another world size, step size or settings.
        """
        check_stream_state(state, self.settings, self.world_size, self.micro_batches)
        position = state.get("positions", {}).get(str(self.rank))
        self.seek(int(state["consumed_samples"]), None if position is None else StreamPosition.from_list(position))

    def close(self) -> None:
        """Stop the tokenize processes."""
        self.packs.close()


def stream_settings(packs: StreamingPacks, tokenizer_fingerprint: str) -> dict[str, Any]:
    """What a rank's pack stream depends on besides the rank, for the resume check (:func:`check_stream_state`):
    the shard lists and tokenize settings (hashed), the tokenizer, window, packing and seed.

    Args:
        packs (StreamingPacks): The stream.
        tokenizer_fingerprint (str): :func:`xtl.data.tokenize.tokenizer_fingerprint` of its tokenizer.

    Returns:
        dict: JSON-serializable settings.
    """
    sources = [{"shards": s.shards, "formats": s.formats, "split": s.split, "weight": s.weight} for s in packs.sources]
    tokenize = [{"fn": type(fn).__qualname__, "config": fn.config()} for fn in packs.tokenize_fns]
    return {
        "sources": _digest(sources),
        "tokenize": _digest(tokenize),
        "tokenizer": tokenizer_fingerprint,
        "window": packs.window,
        "pack_max_length": packs.pack_max_length,
        "packing": packs.packing,
        "overlong": packs.overlong if packs.packing == "best_fit" else None,
        "seed": packs.seed,
    }


def streaming_summary(sources: list[StreamSource], packing: str, pack_max_length: int, window: int) -> str:
    """One line for the start of a streaming run: sources, shards and how they are packed."""
    shards = sum(len(s.shards) for s in sources)
    return (
        f"xtl data: streaming {len(sources)} source(s), {shards} shard(s) -> {packing} packs of <= {pack_max_length} "
        f"tokens from windows of {window} rows per rank (tokenized on the fly, nothing cached)"
    )


def default_stream_workers() -> int:
    """Tokenize processes of a stream when ``tokenize_workers`` is not set: half the CPUs, 1 to 4."""
    return min(4, max(1, (os.cpu_count() or 1) // 2))


def check_stream_state(state: dict[str, Any], settings: dict[str, Any], world_size: int, micro_batches: int) -> None:
    """Refuse a data state that this stream cannot continue exactly.

    Raises:
        DataError: Naming what differs.
    """
    if "streaming" not in state:
        raise DataError(
            "the checkpoint's data state is of a cached (map-style) run; a streaming run cannot continue it: start "
            "the streaming run fresh, or resume with the cached sources"
        )
    saved_world = state.get("world_size", world_size)
    if saved_world != world_size:
        raise DataError(
            f"the checkpoint's data stream was read by {saved_world} data-parallel ranks, this run has {world_size}: "
            "every rank reads its own share of a stream, so a streaming run resumes on the same number of ranks"
        )
    saved_micro = state.get("micro_batches_per_step", micro_batches)
    if saved_micro != micro_batches:
        raise DataError(
            f"the checkpoint's data stream took {saved_micro} packs per rank and step, this run "
            f"data.micro_batches_per_step: {micro_batches}; resume with the same value"
        )
    saved = state["streaming"]
    changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if changed:
        raise DataError(
            f"the checkpoint's data stream was made with other settings ({', '.join(changed)} differ): its position "
            "means nothing in this stream; resume with the same sources, tokenizer and data settings"
        )


# -- worker side -----------------------------------------------------------------------------------------------------

_FNS: list[TokenizeFn] | None = None


def _init_worker(fns: list[TokenizeFn]) -> None:
    global _FNS
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _FNS = fns


def _tokenize_task(task: tuple[int, list[Row], list[str]]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    assert _FNS is not None
    return _tokenize_with(_FNS, task)


def _tokenize_with(
    fns: list[TokenizeFn], task: tuple[int, list[Row], list[str]]
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """The samples of every row of a task as the cache stores them: int32 ids, uint8 loss mask, no empty sample."""
    k, raw, locations = task
    rows = [parse_jsonl_row(row, location) for row, location in zip(raw, locations)]
    results = fns[k].batch_arrays(rows, lambda i: locations[i])
    out = []
    for i, samples in enumerate(results):
        kept = []
        for ids, mask, *_ in samples:
            if len(ids) == 0:
                continue
            if len(mask) != len(ids):
                raise DataError(f"{locations[i]}: tokenize fn returned a loss mask of another length")
            kept.append((np.asarray(ids), np.asarray(mask).astype(np.uint8)))
        out.append(kept)
    flat = [ids for samples in out for ids, _ in samples]
    joined = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
    if len(joined) and (joined.min() < 0 or joined.max() >= 2**31):
        raise DataError(f"tokenize fn for {locations[0]} and the rows after it returned token ids outside int32")
    return [[(ids.astype(np.int32), mask) for ids, mask in samples] for samples in out]


def _digest(value: Any) -> str:
    return xxhash.xxh3_128(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _shutdown(pool: ProcessPoolExecutor) -> None:
    # waits for the running tasks (at most a window's rows): a pool left running at interpreter exit can fail there
    pool.shutdown(wait=True, cancel_futures=True)
