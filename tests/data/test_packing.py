"""Packing: hard (every token once), best-fit (samples intact, overlong policy), preset (validated)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from xtl.data import DataError, DataFileNotFoundError, best_fit_pack, hard_pack, preset_pack


def _lengths(n: int = 500, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.0, 0.9, n).astype(np.int64), 1, 3000)


class TestHardPack:
    def test_every_token_exactly_once(self):
        lengths = _lengths()
        plan = hard_pack(lengths, 512, seed=3)
        seen = Counter()
        for s, a, b in zip(plan.seg_sample, plan.seg_start, plan.seg_end):
            for t in range(a, b):
                seen[(int(s), int(t))] += 1
        assert set(seen.values()) == {1}
        assert len(seen) == int(lengths.sum())
        tokens = plan.pack_tokens()
        assert (tokens[:-1] == 512).all() and 0 < tokens[-1] <= 512
        assert plan.fill_ratio() == pytest.approx(lengths.sum() / (len(plan) * 512))

    def test_deterministic_from_seed(self):
        lengths = _lengths()
        a, b, c = hard_pack(lengths, 256, seed=1), hard_pack(lengths, 256, seed=1), hard_pack(lengths, 256, seed=2)
        assert np.array_equal(a.seg_sample, b.seg_sample) and np.array_equal(a.seg_start, b.seg_start)
        assert not np.array_equal(a.seg_sample, c.seg_sample)


class TestBestFitPack:
    def test_samples_intact_and_fill(self):
        lengths = _lengths(2000)
        lengths = lengths[lengths <= 1024]
        plan = best_fit_pack(lengths, 1024, seed=0)
        assert sorted(plan.seg_sample.tolist()) == list(range(len(lengths)))
        assert (plan.seg_start == 0).all() and np.array_equal(plan.seg_end, lengths[plan.seg_sample])
        assert (plan.pack_tokens() <= 1024).all()
        assert plan.fill_ratio() > 0.95
        assert plan.report()["fill_ratio"] == round(plan.fill_ratio(), 4)

    def test_overlong_policies_are_counted(self):
        lengths = np.array([10, 300, 50, 500, 20])
        truncated = best_fit_pack(lengths, 256, overlong="truncate")
        assert truncated.num_truncated == 2 and truncated.truncated_tokens == 44 + 244
        assert sorted(truncated.seg_sample.tolist()) == [0, 1, 2, 3, 4]
        assert truncated.seg_end[truncated.seg_sample == 3].tolist() == [256]
        dropped = best_fit_pack(lengths, 256, overlong="drop")
        assert dropped.num_dropped == 2 and sorted(dropped.seg_sample.tolist()) == [0, 2, 4]
        with pytest.raises(DataError, match="2 samples exceed pack_max_length=256 .*raise pack_max_length"):
            best_fit_pack(lengths, 256, overlong="error")

    def test_deterministic_from_seed(self):
        lengths = _lengths(300)
        a, b = best_fit_pack(lengths, 4096, seed=5), best_fit_pack(lengths, 4096, seed=5)
        assert np.array_equal(a.seg_sample, b.seg_sample) and np.array_equal(a.pack_offsets, b.pack_offsets)


class TestPresetPack:
    def test_valid_table(self, tmp_path):
        table = np.array([[0, 2, 0, 5], [0, 0, 0, 3], [1, 1, 2, 6]], dtype=np.int64)
        np.save(tmp_path / "p.npy", table)
        plan = preset_pack(tmp_path / "p.npy", np.array([3, 6, 5]), 8)
        assert len(plan) == 2 and plan.pack_tokens().tolist() == [8, 4]

    @pytest.mark.parametrize(
        ("table", "message"),
        [
            (np.zeros((3, 3), dtype=np.int64), r"shape \(3, 3\); expected \(num_segments, 4\)"),
            (np.zeros((1, 4), dtype=np.float32), "dtype float32; expected an integer dtype"),
            (np.array([[0, 7, 0, 1]]), r"row 0 \(value 7\) sample index outside \[0, 3\)"),
            (np.array([[0, 1, 4, 2]]), r"row 0 \(value 4\) needs 0 <= start < end"),
            (np.array([[0, 0, 0, 9]]), r"row 0 \(value 9\) end beyond the sample length"),
            (np.array([[1, 0, 0, 1]]), "pack ids must start at 0"),
            (np.array([[0, 1, 0, 6], [0, 2, 0, 5]]), "pack 0 holds more than pack_max_length=8"),
        ],
    )
    def test_invalid_tables(self, tmp_path, table, message):
        np.save(tmp_path / "p.npy", table)
        with pytest.raises(DataError, match=message):
            preset_pack(tmp_path / "p.npy", np.array([3, 6, 5]), 8)

    def test_missing_file(self, tmp_path):
        with pytest.raises(DataFileNotFoundError, match="pack preset .* does not exist; fix `pack_preset`"):
            preset_pack(tmp_path / "none.npy", np.array([3]), 8)
