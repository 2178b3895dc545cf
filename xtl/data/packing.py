"""Packing: which token ranges of which samples form each pack of at most ``pack_max_length`` tokens.

A ``PackPlan`` is three flat arrays of segments (sample, token start, token end) grouped by pack; every segment is
one document of its pack, so attention and position ids restart at segment boundaries.

- ``hard_pack``: shuffle samples, lay their tokens end to end, cut every ``pack_max_length`` (pretraining; a cut
  document continues in the next pack as a new document).
- ``best_fit_pack``: best-fit decreasing, never splitting a sample (SFT); overlong samples are truncated, dropped
  or rejected by policy and counted. With ``pairs=True`` (preference data) a chosen/rejected pair is the unit: two
  consecutive documents of one pack, never split, never truncated.
- ``preset_pack``: a user ``.npy`` table of ``(pack, sample, start, end)`` rows, validated.

``save_plan`` / ``load_plan`` store a plan as one ``.npz`` (written under a temporary name, then renamed) checked
against ``plan_fingerprint`` of its inputs, so a warm start reads the plan instead of packing again.
``PackedDataset`` reads a pack with one gather from the memory-mapped caches, however many documents it holds.
"""

from __future__ import annotations

import bisect
import inspect
import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

from xtl.data.dataset import MixedDataset
from xtl.data.item import DataError, DataFileNotFoundError
from xtl.utils import apply_umask

OverlongPolicy = Literal["truncate", "drop", "error"]
PackingMode = Literal["hard", "best_fit", "preset"]


@dataclass
class PackPlan:
    """Segments grouped by pack: pack ``p`` holds segments ``pack_offsets[p]:pack_offsets[p+1]``.

    ``pairs``: a preference plan, whose packs hold whole pairs (segments ``2j``, ``2j + 1`` of a pack are mixed samples
    ``2k``, ``2k + 1``, chosen then rejected); ``num_dropped`` then counts documents of dropped pairs (two per pair).
    """

    pack_max_length: int
    pack_offsets: np.ndarray
    seg_sample: np.ndarray
    seg_start: np.ndarray
    seg_end: np.ndarray
    num_dropped: int = 0
    num_truncated: int = 0
    truncated_tokens: int = 0
    pairs: bool = False

    def __len__(self) -> int:
        return len(self.pack_offsets) - 1

    def pack_tokens(self) -> np.ndarray:
        """Real (non-padding) tokens of every pack.

        Returns:
            np.ndarray: int64 ``(num_packs,)``.
        """
        cumulative = np.zeros(len(self.seg_start) + 1, dtype=np.int64)
        np.cumsum(self.seg_end - self.seg_start, out=cumulative[1:])
        offsets = np.asarray(self.pack_offsets, dtype=np.int64)
        return cumulative[offsets[1:]] - cumulative[offsets[:-1]]

    def fill_ratio(self) -> float:
        """Share of non-padding tokens when every pack is padded to ``pack_max_length``.

        Returns:
            float: In ``[0, 1]``.
        """
        if len(self) == 0:
            return 0.0
        return float(self.pack_tokens().sum() / (len(self) * self.pack_max_length))

    def report(self) -> dict[str, float | int]:
        """Counts for logs: packs, documents, fill ratio, dropped and truncated samples (and pairs, for preference).

        Returns:
            dict: The report.
        """
        report: dict[str, float | int] = {
            "packs": len(self),
            "documents": int(len(self.seg_sample)),
            "tokens": int(self.pack_tokens().sum()),
            "fill_ratio": round(self.fill_ratio(), 4),
            "dropped_overlong": self.num_dropped,
            "truncated_overlong": self.num_truncated,
            "truncated_tokens": self.truncated_tokens,
        }
        if self.pairs:
            report["pairs"] = int(len(self.seg_sample)) // 2
            report["dropped_overlong_pairs"] = self.num_dropped // 2
        return report


@dataclass
class Pack:
    """One pack read from the caches: unshifted ids/labels, the length of each document and, for tagged data, the
    tag of each document's sample."""

    index: int
    input_ids: np.ndarray
    labels: np.ndarray
    lengths: list[int]
    tags: list[int] | None = field(default=None, kw_only=True)


class PackedDataset:
    """Map-style dataset of packs over a ``MixedDataset``.

    Args:
        data (MixedDataset): Tokenized samples.
        plan (PackPlan): Which token ranges form each pack.
    """

    def __init__(self, data: MixedDataset, plan: PackPlan) -> None:
        self.data = data
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> Pack:
        plan = self.plan
        a, b = int(plan.pack_offsets[index]), int(plan.pack_offsets[index + 1])
        samples = plan.seg_sample[a:b]
        ids, labels, lengths = self.data.gather(samples, plan.seg_start[a:b], plan.seg_end[a:b])
        tags = None if self.data.tags is None else self.data.tags[np.asarray(samples, dtype=np.int64)].tolist()
        return Pack(index, ids, labels, lengths.tolist(), tags=tags)


def hard_pack(num_tokens: np.ndarray, pack_max_length: int, seed: int = 0, shuffle: bool = True) -> PackPlan:
    """Cut the (seeded-shuffled) token stream of all samples every ``pack_max_length`` tokens.

    Every source token lands in exactly one pack; only the last pack can be short.

    Args:
        num_tokens (np.ndarray): Tokens per sample.
        pack_max_length (int): Pack length.
        seed (int): Seed of the sample order.
        shuffle (bool): Shuffle samples before concatenation.

    Returns:
        PackPlan: The plan.
    """
    _check_length(pack_max_length)
    lengths = np.asarray(num_tokens, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    order = order[lengths[order] > 0]
    doc_len = lengths[order]
    ends = np.cumsum(doc_len)
    starts = ends - doc_len
    first_pack = starts // pack_max_length
    last_pack = (ends - 1) // pack_max_length
    counts = last_pack - first_pack + 1
    seg_doc = np.repeat(np.arange(len(order)), counts)
    within = np.arange(len(seg_doc)) - np.repeat(np.cumsum(counts) - counts, counts)
    seg_pack = first_pack[seg_doc] + within
    stream_start = np.maximum(starts[seg_doc], seg_pack * pack_max_length)
    stream_end = np.minimum(ends[seg_doc], (seg_pack + 1) * pack_max_length)
    num_packs = int(last_pack[-1]) + 1 if len(order) else 0
    pack_offsets = np.searchsorted(seg_pack, np.arange(num_packs + 1), side="left").astype(np.int64)
    return PackPlan(
        pack_max_length,
        pack_offsets,
        order[seg_doc].astype(np.int64),
        (stream_start - starts[seg_doc]).astype(np.int64),
        (stream_end - starts[seg_doc]).astype(np.int64),
    )


def best_fit_pack(
    num_tokens: np.ndarray,
    pack_max_length: int,
    seed: int = 0,
    overlong: OverlongPolicy = "truncate",
    pairs: bool = False,
    locate: Callable[[int], str] | None = None,
) -> PackPlan:
    """Best-fit decreasing: longest samples first, each into the fullest pack that still has room.

    Ties in length are ordered by a seeded shuffle, so the plan is deterministic from ``seed``.

    With ``pairs=True`` (preference data) samples ``2k`` and ``2k + 1`` are one pair (chosen, rejected) and the pair
    is the unit: it goes into one pack as two consecutive documents, chosen first. A pair longer than
    ``pack_max_length`` raises under ``overlong="error"`` and is dropped (counted) under ``"drop"`` and ``"truncate"``:
    cutting a pair would change what it compares.

    Args:
        num_tokens (np.ndarray): Tokens per sample.
        pack_max_length (int): Pack capacity.
        seed (int): Seed of the tie order.
        overlong (str): ``"truncate"`` (keep the first ``pack_max_length`` tokens), ``"drop"`` or ``"error"``.
        pairs (bool): Pack pairs of consecutive samples as units (``num_tokens`` of even length).
        locate (Callable[[int], str] | None): ``pairs`` only: the source location (``file:line``) of pair ``k``,
            named by the overlong error.

    Returns:
        PackPlan: The plan; packs in creation order (the sampler shuffles them).
    """
    _check_length(pack_max_length)
    lengths = np.asarray(num_tokens, dtype=np.int64)
    if pairs:
        return _best_fit_pairs(lengths, pack_max_length, seed, overlong, locate)
    too_long = np.flatnonzero(lengths > pack_max_length)
    num_dropped = num_truncated = truncated_tokens = 0
    if len(too_long):
        if overlong == "error":
            raise DataError(
                f"{len(too_long)} samples exceed pack_max_length={pack_max_length} (longest "
                f"{int(lengths.max())} tokens, e.g. sample {int(too_long[0])}); raise pack_max_length or set "
                "overlong to 'truncate' or 'drop'"
            )
        if overlong == "drop":
            num_dropped = len(too_long)
        else:
            num_truncated = len(too_long)
            truncated_tokens = int((lengths[too_long] - pack_max_length).sum())
    perm = np.random.default_rng(seed).permutation(len(lengths))
    fits = lengths[perm] <= pack_max_length if overlong == "drop" else np.ones(len(perm), dtype=bool)
    perm = perm[fits & (lengths[perm] > 0)]
    sizes = np.minimum(lengths, pack_max_length)
    bins = _best_fit_bins(perm[np.argsort(-sizes[perm], kind="stable")], sizes, pack_max_length)
    seg_sample = np.fromiter((s for b in bins for s in b), dtype=np.int64, count=len(perm))
    pack_offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=pack_offsets[1:])
    return PackPlan(
        pack_max_length,
        pack_offsets,
        seg_sample,
        np.zeros(len(seg_sample), dtype=np.int64),
        sizes[seg_sample].astype(np.int64),
        num_dropped=num_dropped,
        num_truncated=num_truncated,
        truncated_tokens=truncated_tokens,
    )


def _best_fit_pairs(
    lengths: np.ndarray,
    pack_max_length: int,
    seed: int,
    overlong: OverlongPolicy,
    locate: Callable[[int], str] | None,
) -> PackPlan:
    if len(lengths) % 2:
        raise DataError(f"pair packing needs chosen/rejected pairs, got an odd number of samples ({len(lengths)})")
    chosen, rejected = lengths[0::2], lengths[1::2]
    if len(lengths) and min(chosen.min(), rejected.min()) <= 0:
        raise DataError("pair packing got an empty chosen or rejected sample; every side of a pair needs tokens")
    units = chosen + rejected
    too_long = np.flatnonzero(units > pack_max_length)
    if len(too_long) and overlong == "error":
        k = int(too_long[0])
        where = locate(k) if locate is not None else f"pair {k}"
        raise DataError(
            f"{where}: preference pair of {int(units[k])} tokens (chosen {int(chosen[k])} + rejected "
            f"{int(rejected[k])}) exceeds pack_max_length={pack_max_length} ({len(too_long)} pairs do); raise "
            "pack_max_length or set overlong: drop (a pair is dropped, never truncated)"
        )
    perm = np.random.default_rng(seed).permutation(len(units))
    perm = perm[units[perm] <= pack_max_length]
    bins = _best_fit_bins(perm[np.argsort(-units[perm], kind="stable")], units, pack_max_length)
    pair = np.fromiter((u for b in bins for u in b), dtype=np.int64, count=len(perm))
    seg_sample = (2 * pair[:, None] + np.arange(2)).reshape(-1)
    pack_offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([2 * len(b) for b in bins], out=pack_offsets[1:])
    return PackPlan(
        pack_max_length,
        pack_offsets,
        seg_sample,
        np.zeros(len(seg_sample), dtype=np.int64),
        lengths[seg_sample].astype(np.int64),
        num_dropped=2 * len(too_long),
        pairs=True,
    )


def _best_fit_bins(order: np.ndarray, sizes: np.ndarray, pack_max_length: int) -> list[list[int]]:
    """Put the items of ``order`` (in that order) each into the fullest bin that still has room for it."""
    bins: list[list[int]] = []
    free: list[int] = []  # sorted keys remaining * 2**32 + bin id, for bins with room left
    shift = 1 << 32
    for item in order.tolist():
        need = int(sizes[item])
        pos = bisect.bisect_left(free, need * shift)
        if pos < len(free):
            key = free.pop(pos)
            remaining, bin_id = divmod(key, shift)
            bins[bin_id].append(item)
            remaining -= need
        else:
            bin_id = len(bins)
            bins.append([item])
            remaining = pack_max_length - need
        if remaining > 0:
            bisect.insort(free, remaining * shift + bin_id)
    return bins


def preset_pack(path: str | Path, num_tokens: np.ndarray, pack_max_length: int) -> PackPlan:
    """Load and validate a user pack table.

    The ``.npy`` holds an integer array of shape ``(num_segments, 4)``: ``pack, sample, start, end`` per row, rows
    of one pack adjacent, pack ids ``0..P-1`` in order; ``sample`` indexes the mixed dataset, ``[start, end)`` is a
    token range of that sample, and a pack holds at most ``pack_max_length`` tokens.

    Args:
        path (str | Path): The ``.npy`` file.
        num_tokens (np.ndarray): Tokens per mixed sample.
        pack_max_length (int): Pack capacity.

    Returns:
        PackPlan: The plan.
    """
    _check_length(pack_max_length)
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataFileNotFoundError(f"pack preset {path} does not exist; fix `pack_preset`")
    table = np.load(path, mmap_mode="r", allow_pickle=False)
    where = f"pack preset {path}"
    if table.ndim != 2 or table.shape[1] != 4:
        raise DataError(
            f"{where} has shape {table.shape}; expected (num_segments, 4) rows of pack, sample, start, end"
        )
    if not np.issubdtype(table.dtype, np.integer):
        raise DataError(f"{where} has dtype {table.dtype}; expected an integer dtype (e.g. int64)")
    table = np.asarray(table, dtype=np.int64)
    pack, sample, start, end = table.T
    lengths = np.asarray(num_tokens, dtype=np.int64)
    _first_bad(where, (sample < 0) | (sample >= len(lengths)), sample, f"sample index outside [0, {len(lengths)})")
    _first_bad(where, (start < 0) | (start >= end), start, "needs 0 <= start < end")
    _first_bad(where, end > lengths[np.clip(sample, 0, max(len(lengths) - 1, 0))], end, "end beyond the sample length")
    if len(pack) and (pack[0] != 0 or np.any(np.diff(pack) < 0) or np.any(np.diff(pack) > 1)):
        raise DataError(f"{where}: pack ids must start at 0 and increase by 0 or 1 from row to row")
    num_packs = int(pack[-1]) + 1 if len(pack) else 0
    pack_offsets = np.searchsorted(pack, np.arange(num_packs + 1), side="left").astype(np.int64)
    plan = PackPlan(pack_max_length, pack_offsets, sample.copy(), start.copy(), end.copy())
    over = np.flatnonzero(plan.pack_tokens() > pack_max_length)
    if len(over):
        raise DataError(f"{where}: pack {int(over[0])} holds more than pack_max_length={pack_max_length} tokens")
    return plan


PLAN_VERSION = 1
_PLAN_ARRAYS = ("pack_offsets", "seg_sample", "seg_start", "seg_end")


def plan_fingerprint(parts: dict[str, Any]) -> str:
    """Hash of everything a pack plan depends on: ``parts`` plus the code of packing and mixing.

    Args:
        parts (dict): JSON-serializable inputs (cache entries, ratios, seed, packing mode, pack length, ...).

    Returns:
        str: Hex digest.
    """
    import xtl.data.dataset as dataset_module

    h = xxhash.xxh3_128()
    h.update(str(PLAN_VERSION).encode())
    for module in (sys.modules[__name__], dataset_module):
        try:
            h.update(inspect.getsource(module).encode())
        except (OSError, TypeError):
            h.update(module.__name__.encode())
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()


def save_plan(plan: PackPlan, path: str | Path, key: str) -> None:
    """Write a plan as one ``.npz`` file, atomically (a temporary name in the same folder, then a rename).

    Args:
        plan (PackPlan): The plan.
        path (str | Path): Target file.
        key (str): :func:`plan_fingerprint` of its inputs, checked again by :func:`load_plan`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "version": PLAN_VERSION,
        "key": key,
        "pack_max_length": plan.pack_max_length,
        "num_dropped": plan.num_dropped,
        "num_truncated": plan.num_truncated,
        "truncated_tokens": plan.truncated_tokens,
        "pairs": plan.pairs,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), **{name: getattr(plan, name) for name in _PLAN_ARRAYS})
        apply_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_plan(path: str | Path, key: str) -> PackPlan | None:
    """Read a plan written by :func:`save_plan` if it exists, is complete and was made from the same inputs.

    Args:
        path (str | Path): The ``.npz`` file.
        key (str): Expected :func:`plan_fingerprint`.

    Returns:
        PackPlan | None: The plan, or ``None`` (missing, unreadable, or for other inputs).
    """
    try:
        with np.load(Path(path), allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            if meta.get("version") != PLAN_VERSION or meta.get("key") != key:
                return None
            arrays = {name: np.asarray(f[name], dtype=np.int64) for name in _PLAN_ARRAYS}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError):
        return None
    offsets = arrays["pack_offsets"]
    segments = len(arrays["seg_sample"])
    if (
        not len(offsets)
        or offsets[0] != 0
        or offsets[-1] != segments
        or len(arrays["seg_start"]) != segments
        or len(arrays["seg_end"]) != segments
    ):
        return None
    return PackPlan(
        int(meta["pack_max_length"]),
        num_dropped=int(meta["num_dropped"]),
        num_truncated=int(meta["num_truncated"]),
        truncated_tokens=int(meta["truncated_tokens"]),
        pairs=bool(meta.get("pairs", False)),
        **arrays,
    )


def _check_length(pack_max_length: int) -> None:
    if pack_max_length < 2:
        raise DataError(f"pack_max_length must be at least 2, got {pack_max_length}")


def _first_bad(where: str, bad: np.ndarray, values: np.ndarray, reason: str) -> None:
    rows = np.flatnonzero(bad)
    if len(rows):
        row = int(rows[0])
        raise DataError(f"{where}: row {row} (value {int(values[row])}) {reason}; {len(rows)} rows are invalid")
