"""Mixing sources by sample ratio."""

from __future__ import annotations

from collections import Counter

import numpy as np

from xtl.data import JsonlSource, MixedDataset, PretrainTokenizeFn, build_cache

from .conftest import write_jsonl


class TestMixedDataset:
    def test_ratios_repeat_and_subsample(self, tmp_path, qwen_tokenizer):
        fn = PretrainTokenizeFn(qwen_tokenizer)
        a = build_cache(
            JsonlSource(write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(10)])),
            fn,
            tmp_path / "c",
            progress=False,
        )
        b = build_cache(
            JsonlSource(write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(20)])),
            fn,
            tmp_path / "c",
            progress=False,
        )
        mix = MixedDataset([a, b], [2.5, 0.25], seed=7, names=["a", "b"])
        counts = Counter(zip(mix.source_ids.tolist(), mix.sample_ids.tolist()))
        assert len(mix) == 25 + 5
        per_a = Counter(v for (k, _), v in counts.items() if k == 0)
        assert per_a == {2: 5, 3: 5}  # 2 full copies + 5 of 10 once more
        assert sum(1 for k, _ in counts if k == 1) == 5 and max(v for (k, _), v in counts.items() if k == 1) == 1
        assert mix.summary()[1] == {
            "name": "b",
            "samples": 5,
            "tokens": int(mix.num_tokens[mix.source_ids == 1].sum()),
        }
        again = MixedDataset([a, b], [2.5, 0.25], seed=7)
        other = MixedDataset([a, b], [2.5, 0.25], seed=8)
        assert np.array_equal(again.sample_ids, mix.sample_ids)
        assert not np.array_equal(other.sample_ids, mix.sample_ids)
        item = mix[0]
        assert item == fn({"text": "a0"})[0]
