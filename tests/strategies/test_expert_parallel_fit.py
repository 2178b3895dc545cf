"""``xtl fit`` with expert parallelism (configs/tiny_moe_ep.yaml, 2 gloo processes): the same losses as one
process on the same global batch, exact resume, and DCP checkpoints that resume in another layout."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The overrides that make the EP run and the single-process run compute the same thing (docs/configs.md): the
# router losses are normalized per micro-batch over the data-parallel ranks, so they differ between 2 ranks x 2
# micro-batches and 1 rank x 4 micro-batches; with their coefficients at 0 both runs optimize the same objective.
COMPARABLE = ["--model.init_args.routing.balance_loss_coef", "0", "--model.init_args.routing.z_loss_coef", "0"]
SMALL = [
    "--model.init_args.model.hidden_size", "64",
    "--model.init_args.model.moe_intermediate_size", "32",
    "--model.init_args.model.num_hidden_layers", "2",
    "--data.pack_max_length", "128",
    "--data.val_sources", "null",
    "--trainer.val_check_interval", "null",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip
# fp32, same tokens: only the order of sums differs (expert rows grouped by source rank, gradients reduced over
# ranks); the logged losses have been bitwise equal, the stated bound is 1e-5 relative.
RTOL = 1e-5
CHECKPOINT_EVERY_2 = [
    "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt",
    "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1",
    "--model.init_args.schedule.decay_steps", "4",
]  # fmt: skip


def _fit(cwd: Path, recipe: str, cache: Path, *extra: str) -> dict[int, str]:
    cwd.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs" / recipe), *SMALL, *COMPARABLE]
    args += ["--data.cache_dir", str(cache), *extra]
    proc = subprocess.run(args, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses: dict[int, str] = {}
    for metrics in sorted(cwd.glob("runs/*/logs/version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            if row.get("train/loss"):
                losses[int(row["step"])] = row["train/loss"]
    return losses


def _resume_from(run: Path, cwd: Path, cache: Path, recipe: str, *layout: str) -> dict[int, str]:
    """Continue ``run``'s step-2 checkpoint to step 4 in ``cwd``, in the layout ``layout`` gives."""
    (ckpt,) = (run / "runs/tiny_moe_ep/ckpt").glob("*step=2.ckpt")
    assert ckpt.is_dir(), "FSDP/EP checkpoints are DCP directories"
    return _fit(cwd, recipe, cache, "--trainer.max_steps", "4", "--model.init_args.schedule.decay_steps", "4",
                "--ckpt_path", str(ckpt), *layout)  # fmt: skip


def _close(got: dict[int, str], want: dict[int, str], steps: range) -> None:
    for step in steps:
        assert float(got[step]) == pytest.approx(float(want[step]), rel=RTOL), f"step {step}: {got[step]} {want[step]}"


@pytest.mark.distributed
class TestExpertParallelFit:
    @pytest.fixture(scope="class")
    def uninterrupted(self, tmp_path_factory, data_cache) -> tuple[Path, dict[int, str]]:
        """4 EP steps with a checkpoint every 2 steps."""
        cwd = tmp_path_factory.mktemp("ep_full")
        return cwd, _fit(cwd, "tiny_moe_ep.yaml", data_cache, *CHECKPOINT_EVERY_2, "--trainer.max_steps", "4")

    def _resume(self, uninterrupted, tmp_path, data_cache, recipe: str, *layout: str) -> dict[int, str]:
        return _resume_from(uninterrupted[0], tmp_path, data_cache, recipe, *layout)

    def test_an_fsdp_checkpoint_resumes_with_expert_parallelism(self, uninterrupted, tmp_path, data_cache):
        """EP=1 -> EP=2: a checkpoint written without expert parallelism loads with experts split over 2 ranks."""
        _fit(tmp_path / "ep1", "tiny_moe_ep.yaml", data_cache, *CHECKPOINT_EVERY_2, "--trainer.max_steps", "2",
             "--trainer.strategy.init_args.expert_parallel_size", "1")  # fmt: skip
        resumed = _resume_from(tmp_path / "ep1", tmp_path / "ep2", data_cache, "tiny_moe_ep.yaml")
        _close(resumed, uninterrupted[1], range(2, 4))

    def test_equals_one_process_on_the_same_global_batch(self, uninterrupted, tmp_path, data_cache):
        _, ep = uninterrupted
        single = _fit(tmp_path, "tiny_moe_sft.yaml", data_cache, "--data.micro_batches_per_step", "4",
                      "--trainer.max_steps", "3", "--model.init_args.schedule.decay_steps", "4")  # fmt: skip
        assert sorted(single) == [0, 1, 2]
        _close(ep, single, range(3))

    def test_resume_in_the_same_layout_is_exact(self, uninterrupted, tmp_path, data_cache):
        _, full = uninterrupted
        resumed = self._resume(uninterrupted, tmp_path, data_cache, "tiny_moe_ep.yaml")
        assert [resumed[s] for s in (2, 3)] == [full[s] for s in (2, 3)]

    def test_resume_without_expert_parallelism(self, uninterrupted, tmp_path, data_cache):
        resumed = self._resume(uninterrupted, tmp_path, data_cache, "tiny_moe_ep.yaml",
                               "--trainer.strategy.init_args.expert_parallel_size", "1")  # fmt: skip
        _close(resumed, uninterrupted[1], range(2, 4))

    def test_resume_on_one_process(self, uninterrupted, tmp_path, data_cache):
        resumed = self._resume(uninterrupted, tmp_path, data_cache, "tiny_moe_ep.yaml", "--trainer.devices", "1",
                               "--trainer.strategy.init_args.expert_parallel_size", "1",
                               "--data.micro_batches_per_step", "4")  # fmt: skip
        _close(resumed, uninterrupted[1], range(2, 4))
