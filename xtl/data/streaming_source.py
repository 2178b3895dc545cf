"""Streaming sources: raw rows read on the fly from shards, each data-parallel rank reading only its share.

A streaming source is a list of *shards*: JSONL files (local paths or fsspec URLs such as ``memory://``,
``file://``, ``s3://``; compression inferred from the suffix, e.g. ``.jsonl.gz``) read line by line, or files read
through Hugging Face ``datasets`` streaming (``load_dataset(format, data_files=[shard], streaming=True)``: ``json``,
``parquet``). Nothing is downloaded ahead, tokenized ahead or cached.

Every pass (epoch) over a source shuffles its shard order with ``default_rng([seed, source, epoch])``. With at least
as many shards as data-parallel ranks, rank ``r`` of ``w`` reads shards ``order[r::w]`` (and nothing else); with
fewer shards, every rank reads every shard and keeps its rows ``i % w == r`` (row ``i`` counted within its shard).
A rank's pass ends when its share does; it then starts its share of the next pass, independently of the other
ranks, so every rank has an endless stream of rows.

A position in a source is a :class:`SourceCursor` ``(epoch, piece, row)``: the ``piece``-th shard of this rank's
pass ``epoch``, at raw row ``row`` of that shard (rows are non-blank lines for JSONL). Resuming at a cursor opens that
shard and skips ``row`` raw rows without parsing them. Several sources are mixed by a seeded draw per row
(:func:`mix_choices`), so the mixed position is the draw count plus one cursor per source (:class:`StreamCursor`).
"""

from __future__ import annotations

import glob
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xtl.data.item import DataError, DataFileNotFoundError
from xtl.utils import resolve_path

STREAM_FORMATS = ("jsonl", "json", "parquet")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_MIX_BLOCK = 4096

Row = bytes | dict[str, Any]  # a raw JSONL line (parsed by the tokenize worker) or a datasets row


@dataclass(frozen=True)
class Piece:
    """What a rank reads of one shard in one pass: the raw rows ``i`` with ``i % stride == offset``."""

    shard: int
    stride: int = 1
    offset: int = 0


@dataclass(frozen=True)
class SourceCursor:
    """Where the next row of one source comes from: pass ``epoch``, ``piece``-th shard of the rank's pass, raw row
    ``row`` of that shard."""

    epoch: int = 0
    piece: int = 0
    row: int = 0


@dataclass(frozen=True)
class StreamCursor:
    """Position in a rank's mixed row stream: rows drawn so far (``draws``) and the cursor of every source."""

    draws: int
    sources: tuple[SourceCursor, ...]

    @classmethod
    def start(cls, num_sources: int) -> StreamCursor:
        """The beginning of the stream."""
        return cls(0, tuple(SourceCursor() for _ in range(num_sources)))

    def to_list(self) -> list[Any]:
        """Plain ints for a checkpoint: ``[draws, [[epoch, piece, row], ...]]``."""
        return [self.draws, [[c.epoch, c.piece, c.row] for c in self.sources]]

    @classmethod
    def from_list(cls, value: Sequence[Any]) -> StreamCursor:
        """Inverse of :meth:`to_list`."""
        draws, sources = value
        return cls(int(draws), tuple(SourceCursor(*(int(x) for x in c)) for c in sources))


@dataclass
class StreamSource:
    """One streaming source: its shards, their format and its mixing weight.

    Args:
        paths (str | Sequence[str]): A file, a glob (``shards/*.jsonl.gz``), a folder (its files of the format,
            recursively) or a list of them; local paths (``tiny:``, ``env:`` and ``~`` forms too) or fsspec URLs.
        format (str): ``auto`` (from the suffix: ``.jsonl``/``.ndjson`` -> ``jsonl``, ``.json`` -> ``json``,
            ``.parquet`` -> ``parquet``, before a compression suffix), ``jsonl`` (xtl's line reader), or ``json`` /
            ``parquet`` (Hugging Face ``datasets`` streaming).
        split (str | None): ``datasets`` split name (default ``train``).
        name (str | None): Display name.
        weight (float): Share of this source in the mixed row stream (``sample_ratio``).
        key (str): The config key named by errors.
    """

    paths: str | Sequence[str]
    format: str = "auto"
    split: str | None = None
    name: str | None = None
    weight: float = 1.0
    key: str = "data.sources"
    shards: list[str] = field(init=False)
    formats: list[str] = field(init=False)

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise DataError(f"{self.key}: sample_ratio must be > 0, got {self.weight}")
        if self.format not in ("auto", *STREAM_FORMATS):
            raise DataError(
                f"{self.key}: format {self.format!r} cannot stream; a streaming source is jsonl (xtl's reader) or "
                "json / parquet (datasets streaming)"
            )
        self.shards = list_shards(self.paths, self.format, self.key)
        self.formats = [self.format if self.format != "auto" else _detect(s, self.key) for s in self.shards]

    @property
    def display_name(self) -> str:
        """The ``name`` if given, else the stem of the first shard."""
        return self.name or Path(self.shards[0]).name.split(".")[0]

    def pieces(self, epoch: int, seed: int, index: int, rank: int, world_size: int) -> list[Piece]:
        """The shares of shards rank ``rank`` reads in pass ``epoch`` of this source (``index``: its place among
        the sources), in reading order."""
        order = np.random.default_rng([seed, index, epoch]).permutation(len(self.shards)).tolist()
        if len(order) >= world_size:
            return [Piece(s) for s in order[rank::world_size]]
        return [Piece(s, world_size, rank) for s in order]

    def read(self, piece: Piece, start: int = 0) -> Iterator[tuple[int, Row, str]]:
        """The rows of ``piece`` from raw row ``start`` on: ``(raw row index, row, location)``.

        JSONL rows are the raw line bytes (blank lines are not rows), parsed by
        :func:`xtl.data.sources.parse_jsonl_row` in the tokenize worker; ``datasets`` rows are dicts.
        """
        shard = self.shards[piece.shard]
        if self.formats[piece.shard] == "jsonl":
            rows = _jsonl_rows(shard, start)
        else:
            rows = _datasets_rows(shard, self.formats[piece.shard], self.split, start)
        for index, row, location in rows:
            if index % piece.stride == piece.offset:
                yield index, row, location


class SourceReader:
    """One source's endless row stream for one rank, from a cursor on, with the cursor of the next row.

    ``next()`` returns a row, its location and whether it ended this rank's pass (the next row belongs to the next
    pass); :attr:`cursor` is then the position of the row after it.

    Args:
        source (StreamSource): The source.
        index (int): Its place among the sources (part of its shard-order seed).
        seed (int): Seed of the shard orders.
        rank (int): Data-parallel rank.
        world_size (int): Data-parallel ranks.
        cursor (SourceCursor): Where to start.
    """

    def __init__(
        self, source: StreamSource, index: int, seed: int, rank: int, world_size: int, cursor: SourceCursor
    ) -> None:
        self.source = source
        self.index = index
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._rows = self._walk(cursor)
        self._next = next(self._rows)

    @property
    def cursor(self) -> SourceCursor:
        """Position of the next row."""
        return self._next[0]

    def next(self) -> tuple[Row, str, bool]:
        """The next row, its location and whether it was the last of its pass."""
        cursor, row, location = self._next
        self._next = next(self._rows)
        return row, location, self._next[0].epoch != cursor.epoch

    def close(self) -> None:
        """Close the open shard."""
        self._rows.close()

    def _walk(self, cursor: SourceCursor) -> Iterator[tuple[SourceCursor, Row, str]]:
        epoch, first_piece, first_row = cursor.epoch, cursor.piece, cursor.row
        while True:
            pieces = self.source.pieces(epoch, self.seed, self.index, self.rank, self.world_size)
            found = False
            for p in range(first_piece, len(pieces)):
                for raw, row, location in self.source.read(pieces[p], first_row if p == first_piece else 0):
                    found = True
                    yield SourceCursor(epoch, p, raw), row, location
            if not found and first_piece == 0 and first_row == 0:
                raise DataError(
                    f"{self.source.key}: rank {self.rank} of {self.world_size} gets no rows of "
                    f"{self.source.display_name} ({len(self.source.shards)} shard(s)); add rows or shards"
                )
            epoch, first_piece, first_row = epoch + 1, 0, 0


def mix_choices(weights: Sequence[float], seed: int, rank: int, start: int, count: int) -> np.ndarray:
    """The sources of draws ``start .. start + count - 1`` of rank ``rank``'s mixed stream.

    Draw ``n`` picks source ``k`` with probability ``weights[k] / sum(weights)``, from a generator seeded with
    ``[seed, rank, n // 4096]`` (one per block of 4096 draws), so any draw is found without replaying the ones before.

    Returns:
        np.ndarray: int64 source indices.
    """
    if len(weights) == 1:
        return np.zeros(count, dtype=np.int64)
    p = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    out = np.empty(count, dtype=np.int64)
    n = start
    while n < start + count:
        block, within = divmod(n, _MIX_BLOCK)
        choices = np.random.default_rng([seed, rank, block]).choice(len(p), size=_MIX_BLOCK, p=p)
        take = min(_MIX_BLOCK - within, start + count - n)
        out[n - start : n - start + take] = choices[within : within + take]
        n += take
    return out


def list_shards(paths: str | Sequence[str], format: str = "auto", key: str = "data.sources") -> list[str]:
    """The shard files of a path, glob, folder or list of them, sorted within each entry.

    Args:
        paths (str | Sequence[str]): Local paths or fsspec URLs (``protocol://...``).
        format (str): Format of the files (``auto``: every file with a streamable suffix).
        key (str): The config key named by errors.

    Returns:
        list[str]: Local paths or URLs.
    """
    entries = [paths] if isinstance(paths, str) else list(paths)
    shards: list[str] = []
    for entry in entries:
        found = _url_files(entry, format) if "://" in entry else _local_files(resolve_path(entry), format)
        if not found:
            raise DataFileNotFoundError(
                f"{key}: streaming source {entry} matches no {'data' if format == 'auto' else format} files; fix "
                "its path (a file, a glob such as shards/*.jsonl.gz, a folder or an fsspec URL)"
            )
        shards += found
    return shards


# -- private ---------------------------------------------------------------------------------------------------------


def _jsonl_rows(shard: str, start: int) -> Iterator[tuple[int, bytes, str]]:
    import fsspec

    index = 0
    with fsspec.open(shard, "rb", compression="infer") as f:
        for lineno, line in enumerate(f, start=1):
            line = line[:-1] if line.endswith(b"\n") else line
            if line in (b"", b"\r"):  # blank lines are not rows (as in JsonlSource)
                continue
            if index >= start:
                yield index, line, f"{shard}:{lineno}"
            index += 1


def _datasets_rows(shard: str, format: str, split: str | None, start: int) -> Iterator[tuple[int, dict, str]]:
    import datasets

    split = split or "train"
    dataset = datasets.load_dataset(format, data_files={split: [shard]}, split=split, streaming=True)
    for index, row in enumerate(dataset.skip(start) if start else dataset, start=start):
        yield index, dict(row), f"{shard}[row {index}]"


def _detect(shard: str, key: str) -> str:
    name = shard.lower()
    for suffix in _COMPRESSIONS:
        name = name.removesuffix(suffix)
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    raise DataError(f"{key}: cannot tell the format of shard {shard} from its suffix; set `format` on this source")


def _streamable(name: str, format: str) -> bool:
    name = name.lower()
    for suffix in _COMPRESSIONS:
        name = name.removesuffix(suffix)
    suffixes = {"jsonl": _JSONL_SUFFIXES, "json": (".json", *_JSONL_SUFFIXES), "parquet": (".parquet",)}
    return name.endswith(suffixes.get(format, (*_JSONL_SUFFIXES, ".json", ".parquet")))


def _local_files(path: str, format: str) -> list[str]:
    if glob.has_magic(path):
        return sorted(p for p in glob.glob(path, recursive=True) if Path(p).is_file())
    target = Path(path)
    if target.is_dir():
        return sorted(str(p) for p in target.rglob("*") if p.is_file() and _streamable(p.name, format))
    return [str(target)] if target.is_file() else []


def _url_files(url: str, format: str) -> list[str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if glob.has_magic(path):
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        found = [p for p in fs.find(path) if _streamable(p.rsplit("/", 1)[-1], format)]
    else:
        found = [path] if fs.exists(path) else []
    return sorted(fs.unstrip_protocol(p) for p in found)
