"""Step samplers: rank slicing, resume from consumed_samples, length grouping, preset orders."""

from __future__ import annotations

import numpy as np
import pytest

from xtl.data import DataError, StepSampler


def _steps(sampler: StepSampler) -> list[list[int]]:
    flat = list(sampler)
    m = sampler.micro_batches
    return [flat[i : i + m] for i in range(0, len(flat), m)]


class TestStepSampler:
    def test_ranks_partition_each_step(self):
        per_rank = [_steps(StepSampler(103, 3, rank=r, world_size=2, seed=1)) for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1]) == 103 // 6
        seen = [i for step in zip(*per_rank) for part in step for i in part]
        assert len(seen) == len(set(seen)) == 102
        single = StepSampler(103, 6, seed=1)
        assert [a + b for a, b in zip(*per_rank)] == _steps(single)

    def test_resume_from_consumed_samples(self):
        full = StepSampler(50, 2, rank=1, world_size=2, seed=0)
        full.consumed_samples = 0
        uninterrupted = _steps(full) + _steps(_with(full, consumed=48))
        resumed = _steps(_with(full, consumed=20))
        assert resumed == uninterrupted[5:12]
        next_epoch = _steps(_with(full, consumed=48))
        assert next_epoch != uninterrupted[:12]  # a new permutation each epoch

    def test_set_epoch_does_not_change_order(self):
        sampler = StepSampler(40, 2, seed=3)
        before = list(sampler)
        sampler.set_epoch(7)
        assert list(sampler) == before

    def test_length_grouped_balances_ranks(self):
        rng = np.random.default_rng(0)
        tokens = rng.integers(100, 4096, 512)
        kwargs = {"num_packs": 512, "micro_batches_per_step": 4, "world_size": 4, "seed": 0}
        grouped = [_steps(StepSampler(**kwargs, rank=r, order="length_grouped", pack_tokens=tokens)) for r in range(4)]
        rand = [_steps(StepSampler(**kwargs, rank=r)) for r in range(4)]

        def imbalance(per_rank):
            loads = np.array([[tokens[s].sum() for s in steps] for steps in per_rank])  # (rank, step)
            return float(np.mean(loads.max(0) - loads.min(0)))

        assert sorted(i for r in grouped for s in r for i in s) == list(range(512))
        assert imbalance(grouped) < imbalance(rand) / 4

    def test_too_few_packs(self):
        with pytest.raises(DataError, match=r"only 3 packs, but one optimizer step needs 4 \(world_size 2"):
            StepSampler(3, 2, world_size=2)


class TestPresetSampler:
    def test_rounded_down_and_sliced(self, tmp_path):
        np.save(tmp_path / "o.npy", np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1], dtype=np.int64))
        r0 = StepSampler(10, 2, rank=0, world_size=2, order="preset", preset=str(tmp_path / "o.npy"))
        r1 = StepSampler(10, 2, rank=1, world_size=2, order="preset", preset=str(tmp_path / "o.npy"))
        assert r0.samples_per_epoch == 8
        assert _steps(r0) == [[9, 8], [5, 4]] and _steps(r1) == [[7, 6], [3, 2]]

    @pytest.mark.parametrize(
        ("order", "message"),
        [
            (np.zeros((2, 2), dtype=np.int64), r"shape \(2, 2\); expected a 1-D array"),
            (np.zeros(4, dtype=np.float64), "dtype float64; expected an integer dtype"),
            (np.array([0, 1, 12, 3]), r"entry 2 is 12, outside \[0, 10\) packs"),
            (np.array([0]), "fewer than one global batch"),
        ],
    )
    def test_invalid_presets(self, tmp_path, order, message):
        np.save(tmp_path / "o.npy", order)
        with pytest.raises(DataError, match=message):
            StepSampler(10, 2, order="preset", preset=str(tmp_path / "o.npy"))


def _with(sampler: StepSampler, consumed: int) -> StepSampler:
    clone = StepSampler(
        sampler.num_packs,
        sampler.micro_batches,
        sampler.rank,
        sampler.world_size,
        sampler.seed,
        consumed_samples=consumed,
    )
    return clone
