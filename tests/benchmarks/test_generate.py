"""``benchmarks/generate.py``: both sides decode the same greedy tokens from the same prompts and weights."""

from __future__ import annotations

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def sides():
    return load_benchmark("generate").build_sides(batch=4, group=2)


class TestGenerateBenchmark:
    @pytest.mark.parametrize("prefill", ["packed", "padded"])
    def test_both_sides_decode_the_same_greedy_tokens(self, sides, prefill: str) -> None:
        bench = load_benchmark("generate")
        greedy = bench.Sampling(new_tokens=12)
        xtl = bench.run_xtl(sides, greedy, prefill)
        assert xtl == bench.run_hf(sides, greedy)
        assert len(xtl) == 4 and all(len(row) == 12 for row in xtl)
        assert xtl[0] == xtl[1] and xtl[0] != xtl[2]  # a group repeats its prompt; the prompts differ

    def test_a_changed_prompt_changes_the_tokens(self, sides) -> None:
        """The check can fail: the transformers side on other ids decodes other tokens."""
        bench = load_benchmark("generate")
        greedy = bench.Sampling(new_tokens=12)
        reference = bench.run_hf(sides, greedy)
        sides.input_ids[0, -1] = (int(sides.input_ids[0, -1]) + 1) % 1600
        try:
            assert bench.run_hf(sides, greedy)[0] != reference[0]
            assert bench.run_xtl(sides, greedy) != bench.run_hf(sides, greedy)
        finally:
            sides.input_ids[0, -1] = sides.prompts[0][-1]

    def test_sampled_runs_decode_the_asked_budget_on_both_sides(self, sides) -> None:
        bench = load_benchmark("generate")
        sampled = bench.Sampling(new_tokens=6, temperature=1.0, top_p=0.9, top_k=20, seed=3)
        assert bench.hf_generation_kwargs(sampled)["top_k"] == 20
        assert bench.xtl_generation_config(sampled).do_sample
        for run in (bench.run_xtl, bench.run_hf):
            rows = run(sides, sampled)
            assert [len(row) for row in rows] == [6] * 4
            assert rows == run(sides, sampled)  # seeded: the same draw twice
