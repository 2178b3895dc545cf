"""The CPU-testable parts of ``benchmarks/gpu_throughput.py``: arguments, configuration matrix, FLOPs and MFU."""

from __future__ import annotations

import pytest

from tests.benchmarks import load_benchmark
from xtl.model.dims import ModelDims


class TestGpuThroughput:
    def test_default_matrix_covers_every_model_pack_and_configuration(self) -> None:
        bench = load_benchmark("gpu_throughput")
        runs = bench.parse_args([]).matrix
        assert len(runs) == 2 * 2 * 7
        assert [(r.model, r.seq) for r in runs[:8:7]] == [("dense", 4096), ("dense", 16384)]
        names = [r.name for r in runs[:7]]
        assert names == ["baseline", "flash", "fused", "ckpt", "compile", "fp8", "flash+fused+compile+fp8"]
        assert [r.attn_impl for r in runs[:2]] == ["sdpa", "flash"]

    def test_dry_run_names_each_configuration_and_what_it_turns_on(self, capsys) -> None:
        bench = load_benchmark("gpu_throughput")
        assert bench.main(["--dry-run", "--models", "dense", "--seqs", "4096", "--configs", "baseline,fused+fp8"]) == 0
        out = capsys.readouterr().out
        assert "  baseline: attn_impl: sdpa, separate projections, no callbacks" in out
        assert "  fused+fp8: fused_projections: true (one q/k/v and one gate/up matmul); " in out
        assert "FP8Training(recipe=tensorwise)" in out

    def test_fused_configuration_builds_fused_projections(self) -> None:
        bench = load_benchmark("gpu_throughput")
        assert bench.model_config("dense", fused=True).fused_projections
        assert not bench.model_config("dense").fused_projections

    def test_feature_order_and_duplicates_do_not_change_the_matrix(self) -> None:
        bench = load_benchmark("gpu_throughput")
        runs = bench.parse_args(["--models", "moe", "--seqs", "4096", "--configs", "fp8+flash,flash+fp8"]).matrix
        assert [r.name for r in runs] == ["flash+fp8"]

    @pytest.mark.parametrize("argv", [["--configs", "baseline,turbo"], ["--models", "dense,big"], ["--steps", "4"]])
    def test_bad_arguments_exit_2(self, argv: list[str]) -> None:
        with pytest.raises(SystemExit) as err:
            load_benchmark("gpu_throughput").parse_args(argv)
        assert err.value.code == 2

    def test_document_lengths_fill_the_pack(self) -> None:
        bench = load_benchmark("gpu_throughput")
        lengths = bench.document_lengths(16384, 2048)
        assert sum(lengths) == 16384 and len(set(lengths)) > 1
        assert all(1 <= n <= 3072 for n in lengths) and all(n >= 1024 for n in lengths[:-1])
        assert lengths == bench.document_lengths(16384, 2048)  # seeded
        assert bench.document_lengths(4096, 0) == [4096] == bench.document_lengths(4096, 8192)

    def test_flops_and_mfu_come_from_model_dims(self) -> None:
        bench = load_benchmark("gpu_throughput")
        dims = ModelDims.from_config(bench.model_config("dense"))
        per_step = bench.flops_per_step(dims, [2048, 2048, 904])
        assert per_step == pytest.approx(2 * 2048 * dims.flops_per_token(2048) + 904 * dims.flops_per_token(904))
        flops_per_token = bench.flops_per_step(dims, [4096]) / 4096
        assert flops_per_token == pytest.approx(dims.flops_per_token(4096))
        assert bench.mfu(20_000.0, flops_per_token, 989.0) == pytest.approx(20_000 * flops_per_token / 989e12)

    def test_without_cuda_it_exits_2_before_building(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        bench = load_benchmark("gpu_throughput")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("measured without CUDA"))
        assert bench.main(["--models", "dense", "--seqs", "4096", "--configs", "baseline"]) == 2
