"""Packing: hard (every token once), best-fit (samples intact, overlong policy), preset (validated)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from xtl.data import (
    DataError,
    DataFileNotFoundError,
    JsonlSource,
    MixedDataset,
    PackedDataset,
    PretrainTokenizeFn,
    best_fit_pack,
    build_cache,
    hard_pack,
    preset_pack,
)
from xtl.data.packing import load_plan, plan_fingerprint, save_plan

from .conftest import write_jsonl


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


def _per_segment(packs: PackedDataset, index: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The reference reader: one ``tokens`` call per segment."""
    plan = packs.plan
    parts = [
        packs.data.tokens(int(plan.seg_sample[s]), int(plan.seg_start[s]), int(plan.seg_end[s]))
        for s in range(int(plan.pack_offsets[index]), int(plan.pack_offsets[index + 1]))
    ]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), [len(p[0]) for p in parts]


class TestPackedDataset:
    @pytest.mark.parametrize("packing", ["hard", "best_fit"])
    def test_one_gather_equals_per_segment_reads(self, tmp_path, qwen_tokenizer, packing):
        fn = PretrainTokenizeFn(qwen_tokenizer)
        caches = [
            build_cache(
                JsonlSource(
                    write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name} {i} " * (1 + i % 9)} for i in range(n)])
                ),
                fn,
                tmp_path / "cache",
                progress=False,
            )
            for name, n in (("alpha", 60), ("beta", 40))
        ]
        data = MixedDataset(caches, [1.5, 0.5], seed=3)
        plan = hard_pack(data.num_tokens, 40, seed=1) if packing == "hard" else best_fit_pack(data.num_tokens, 40)
        packs = PackedDataset(data, plan)
        mixed_sources = 0
        for index in range(len(packs)):
            pack = packs[index]
            ids, labels, lengths = _per_segment(packs, index)
            assert np.array_equal(pack.input_ids, ids) and np.array_equal(pack.labels, labels)
            assert pack.lengths == lengths and pack.input_ids.dtype == np.int64
            seg = slice(int(plan.pack_offsets[index]), int(plan.pack_offsets[index + 1]))
            mixed_sources += len(set(data.source_ids[plan.seg_sample[seg]].tolist())) > 1
        assert mixed_sources > 0, "some packs hold documents of both sources"
        if packing == "hard":
            assert (plan.seg_start > 0).any(), "some segments start inside a sample"


class TestStoredPlan:
    def test_round_trip(self, tmp_path):
        plan = best_fit_pack(np.array([10, 300, 50, 500, 20]), 256)
        save_plan(plan, tmp_path / "plans" / "p.npz", "key-1")
        loaded = load_plan(tmp_path / "plans" / "p.npz", "key-1")
        assert loaded is not None
        for name in ("pack_offsets", "seg_sample", "seg_start", "seg_end"):
            assert np.array_equal(getattr(loaded, name), getattr(plan, name))
        assert loaded.report() == plan.report() and loaded.num_truncated == 2
        assert [p.name for p in (tmp_path / "plans").iterdir()] == ["p.npz"], "no temporary file left"

    def test_other_key_missing_or_damaged_file_is_a_miss(self, tmp_path):
        path = tmp_path / "p.npz"
        assert load_plan(path, "k") is None
        save_plan(hard_pack(_lengths(50), 128), path, "k")
        assert load_plan(path, "other inputs") is None
        path.write_bytes(path.read_bytes()[:100])
        assert load_plan(path, "k") is None

    def test_failed_write_leaves_nothing(self, tmp_path, monkeypatch):
        def broken(*args, **kwargs):
            raise OSError("disk full")

        monkeypatch.setattr(np, "savez", broken)
        with pytest.raises(OSError, match="disk full"):
            save_plan(hard_pack(_lengths(50), 128), tmp_path / "p.npz", "k")
        assert list(tmp_path.iterdir()) == []

    def test_fingerprint_follows_every_input(self):
        parts = {"caches": ["a-1"], "seed": 0, "packing": "best_fit", "pack_max_length": 256, "overlong": "truncate"}
        keys = {plan_fingerprint(parts)}
        for change in (
            {"caches": ["a-2"]},
            {"seed": 1},
            {"packing": "hard"},
            {"pack_max_length": 512},
            {"overlong": "drop"},
        ):
            keys.add(plan_fingerprint({**parts, **change}))
        assert len(keys) == 6 and plan_fingerprint(dict(parts)) in keys
