"""A mix of tokenized sources with per-source sample ratios, deterministic from the seed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xtl.data.cache import TokenizedCache
from xtl.data.item import IGNORE_INDEX, DataError, DataItem


class MixedDataset:
    """Tokenized samples of several sources, each repeated or subsampled by its ``sample_ratio``.

    A ratio ``r`` on ``n`` samples keeps ``round(r * n)`` of them: ``floor(r)`` full copies plus a seeded random
    subset (without replacement) for the fraction. Sample ``i`` of the mix is ``(source, sample)`` =
    ``(source_ids[i], sample_ids[i])``; sources follow each other in the given order.

    With ``pairs=True`` (preference data) every cache holds pairs, samples ``2k`` (chosen) and ``2k + 1`` (rejected)
    of one row, and the ratio applies to pairs: ``round(r * n / 2)`` pairs are kept, repeated or subsampled whole, so
    mixed samples ``2j`` and ``2j + 1`` are always one pair, chosen first.

    Args:
        caches (Sequence[TokenizedCache]): One cache entry per source.
        ratios (Sequence[float]): Sample ratio per source (> 0).
        seed (int): Seed of the subsampling.
        names (Sequence[str] | None): Source names, for reports.
        pairs (bool): Mix pairs of consecutive samples instead of samples (every cache must hold pairs).
    """

    def __init__(
        self,
        caches: Sequence[TokenizedCache],
        ratios: Sequence[float],
        seed: int = 0,
        names: Sequence[str] | None = None,
        pairs: bool = False,
    ) -> None:
        if len(caches) != len(ratios):
            raise DataError(f"{len(caches)} sources but {len(ratios)} sample ratios")
        self.caches = list(caches)
        self.names = list(names) if names is not None else [c.directory.name for c in caches]
        self.pairs = pairs
        source_ids, sample_ids = [], []
        for k, (cache, ratio) in enumerate(zip(caches, ratios)):
            if not ratio > 0:
                raise DataError(f"sample_ratio of source {self.names[k]!r} must be > 0, got {ratio}")
            rng = np.random.default_rng([seed, k])
            if pairs:
                rows = np.asarray(cache.rows)
                if len(rows) % 2 or not np.array_equal(rows[0::2], rows[1::2]):
                    raise DataError(
                        f"source {self.names[k]!r} does not hold chosen/rejected pairs (two consecutive samples per "
                        "row); preference sets need kind: preference on every source"
                    )
                picked = (2 * _ratio_indices(len(cache) // 2, ratio, rng)[:, None] + np.arange(2)).reshape(-1)
            else:
                picked = _ratio_indices(len(cache), ratio, rng)
            source_ids.append(np.full(len(picked), k, dtype=np.int32))
            sample_ids.append(picked)
        self.source_ids = np.concatenate(source_ids) if source_ids else np.zeros(0, dtype=np.int32)
        self.sample_ids = np.concatenate(sample_ids) if sample_ids else np.zeros(0, dtype=np.int64)
        per_source = [c.num_tokens for c in caches]
        self.num_tokens = (
            np.concatenate([per_source[k][s] for k, s in zip(range(len(caches)), sample_ids)])
            if caches
            else np.zeros(0, dtype=np.int64)
        ).astype(np.int64)
        # The tag of every mixed sample, when its caches keep tags (unpaired rows' labels, preference pairs' margins).
        self.tags: np.ndarray | None = None
        if any(c.tags is not None for c in caches):
            self.tags = np.concatenate(
                [
                    np.asarray(c.tags)[s] if c.tags is not None else np.zeros(len(s), np.int8)
                    for c, s in zip(caches, sample_ids)
                ]
            )  # int8 labels, or float32 margins (a source without margins: 0)
        # Where every mixed sample starts in the flat token arrays of its cache (for one-gather pack reads).
        self.token_base = (
            np.concatenate([np.asarray(c.offsets[:-1])[s] for c, s in zip(caches, sample_ids)])
            if caches
            else np.zeros(0, dtype=np.int64)
        ).astype(np.int64)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> DataItem:
        return self.caches[int(self.source_ids[index])].item(int(self.sample_ids[index]))

    def tokens(self, index: int, start: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Ids and unshifted labels of mixed sample ``index`` (optionally a token slice).

        Args:
            index (int): Mixed sample index.
            start (int): First token.
            end (int | None): One past the last token.

        Returns:
            tuple[np.ndarray, np.ndarray]: int64 ids and labels.
        """
        return self.caches[int(self.source_ids[index])].tokens(int(self.sample_ids[index]), start, end)

    def gather(
        self, samples: np.ndarray, starts: np.ndarray, ends: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Token ranges of several mixed samples laid end to end, read with one gather per source.

        Args:
            samples (np.ndarray): Mixed sample index of every range.
            starts (np.ndarray): First token of every range within its sample.
            ends (np.ndarray): One past the last token of every range.

        Returns:
            tuple[np.ndarray, np.ndarray, np.ndarray]: int64 ids and unshifted labels of all ranges back to back,
            and the int64 length of every range.
        """
        samples = np.asarray(samples, dtype=np.int64)
        lengths = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
        total = int(lengths.sum())
        if total == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty.copy(), lengths
        # index of output token t in its cache = first token of its range + (t - where the range begins in the output)
        first = self.token_base[samples] + starts
        index = np.repeat(first - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)
        sources = self.source_ids[samples]
        if (sources == sources[0]).all():
            cache = self.caches[int(sources[0])]
            ids = np.asarray(cache.input_ids)[index].astype(np.int64)
            mask = np.asarray(cache.loss_mask)[index].astype(bool)
        else:
            ids, mask = np.empty(total, dtype=np.int64), np.empty(total, dtype=bool)
            token_source = np.repeat(sources, lengths)
            for k in np.unique(sources).tolist():
                sel = token_source == k
                ids[sel] = np.asarray(self.caches[k].input_ids)[index[sel]]
                mask[sel] = np.asarray(self.caches[k].loss_mask)[index[sel]]
        return ids, np.where(mask, ids, IGNORE_INDEX), lengths

    def summary(self) -> list[dict[str, int | str]]:
        """Per-source sample and token counts in the mix (and pairs, for preference data).

        Returns:
            list[dict]: One row per source.
        """
        rows = []
        for k, name in enumerate(self.names):
            sel = self.source_ids == k
            samples = int(sel.sum())
            row: dict[str, int | str] = {"name": name, "samples": samples, "tokens": int(self.num_tokens[sel].sum())}
            if self.pairs:
                row["pairs"] = samples // 2
            rows.append(row)
        return rows


def _ratio_indices(n: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    total = int(round(n * ratio))
    full, rest = divmod(total, n) if n else (0, 0)
    parts = [np.arange(n, dtype=np.int64)] * full
    if rest:
        parts.append(np.sort(rng.choice(n, size=rest, replace=False)).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
