"""``benchmarks/data_streaming.py``: both sides read the same corpus with the same settings and deliver their steps
(a shrunk corpus; nothing is timed here)."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks import load_benchmark


def _args(tmp_path, **kw) -> argparse.Namespace:
    bench = load_benchmark("data_streaming")
    base = ["--rows", "700", "--shards", "1", "--steps", "6", "--pack", "256", "--window", "100000", "--workers", "0"]
    args = bench.parse_args([*base, "--out", str(tmp_path)])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


class TestDataStreamingBenchmark:
    def test_a_window_holding_the_corpus_streams_the_cached_sides_steps(self, tmp_path) -> None:
        bench = load_benchmark("data_streaming")
        args = _args(tmp_path)
        corpus = bench.write_corpus(tmp_path / "corpus", args.rows, args.shards)
        assert len((corpus / "all.jsonl").read_text().splitlines()) == 700
        assert (corpus / "shard000.jsonl").read_text() == (corpus / "all.jsonl").read_text()
        sides = [make(corpus, tmp_path / "cache", args) for make in (bench.streaming_module, bench.cached_module)]
        steps = []
        for module in sides:
            module.setup()
            loader = module.train_dataloader()
            steps.append(
                [
                    [(mb.seq_ctx.input_ids.tolist(), mb.labels.tolist()) for mb in step]
                    for step, _ in zip(loader, range(6))
                ]
            )
        assert steps[0] == steps[1] and len(steps[0]) == 6

    @pytest.mark.parametrize("workers", [0, 1])
    def test_each_side_delivers_its_steps_and_counts_real_tokens(self, workers, tmp_path) -> None:
        bench = load_benchmark("data_streaming")
        args = _args(tmp_path, shards=3, window=64, workers=workers)
        corpus = bench.write_corpus(tmp_path / "corpus", args.rows, args.shards)
        for make in (bench.streaming_module, bench.cached_module):
            delivered = bench.run_side(make(corpus, tmp_path / "cache", args), args.steps)
            assert delivered.steps == 6 and 0 < delivered.tokens <= 6 * 2 * 256 and delivered.seconds > 0

    def test_main_prints_both_configurations_and_the_median_ratio(self, tmp_path, capsys) -> None:
        bench = load_benchmark("data_streaming")
        base = ["--rows", "700", "--shards", "3", "--steps", "3", "--pack", "256", "--window", "64", "--workers", "0"]
        bench.main([*base, "--pairs", "5", "--warmup", "0", "--out", str(tmp_path)])
        out = capsys.readouterr().out
        assert "streaming: tokenizer=tiny:" in out and "cached: tokenizer=tiny:" in out
        assert "ratio streaming/cached (warm) median" in out and "5 pairs" in out
        assert "cold cached path (tokenize 700 rows" in out
