"""Preference optimization through ``xtl fit`` (``configs/tiny_dpo.yaml`` with a tiny random model): FSDP on 2 ranks
equals one process, LoRA trains against its adapters-off reference, and MoE with expert parallelism and activation
checkpointing resumes exactly."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
MOE = {
    **TINY_MODEL,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}
LOGGED = ("train/loss", "train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen")
FSDP = (
    "trainer:\n  devices: 2\n  precision: 32-true\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n"
    "    init_args:\n"
    "      process_group_backend: gloo\n{extra}"
)
# fp32; 2 ranks x 2 micro-batches vs 1 x 4: the same pairs, only the order of sums differs
RTOL = 1e-5


def _fit(work: Path, cache: Path, model: dict, *extra: str, fragment: str = "") -> tuple[dict[int, dict], str]:
    """``xtl fit`` of the tiny DPO recipe with ``model`` in ``work``; the logged rows by step and the output."""
    work.mkdir(parents=True, exist_ok=True)
    override = work / "override.yaml"
    override.write_text(
        f"model:\n  init_args:\n    model: {model}\n    objective: {{loss_type: sigmoid, beta: 0.1, rpo_alpha: 0.5}}\n"
        "trainer:\n  precision: 32-true\n  val_check_interval: null\n  enable_progress_bar: false\n"
        "  num_sanity_val_steps: 0\n  callbacks: []\ndata:\n  val_sources: null\n  pack_max_length: 128\n"
    )
    args = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs/tiny_dpo.yaml"), "--config"]
    args += [str(override), "--data.cache_dir", str(cache), "--trainer.max_steps", "3"]
    if fragment:  # a file of its own: a second ``trainer:`` key in one YAML file would replace the first
        (work / "fragment.yaml").write_text(fragment)
        args += ["--config", str(work / "fragment.yaml")]
    args += extra
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    rows: dict[int, dict] = {}
    for metrics in sorted(work.glob("runs/tiny_dpo/logs/version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            if row.get("train/loss"):
                rows[int(row["step"])] = {k: float(v) for k, v in row.items() if v}
    return rows, proc.stdout + proc.stderr


def _close(got: dict[int, dict], want: dict[int, dict], steps: range) -> None:
    for step in steps:
        for key in LOGGED:
            assert got[step][key] == pytest.approx(want[step][key], rel=RTOL, abs=1e-7), (step, key)


@pytest.mark.slow
@pytest.mark.distributed
class TestPreferenceFit:
    def test_fsdp_on_two_ranks_equals_one_process(self, tmp_path, data_cache):
        """DPO + an NLL term (normalized over the step's chosen tokens) with a live reference sharded like the
        policy: the same losses and reward metrics as one process reading the same pairs."""
        sharded, err = _fit(tmp_path / "fsdp", data_cache, TINY_MODEL, fragment=FSDP.format(extra=""))
        assert "reference: live" in err
        single, _ = _fit(tmp_path / "one", data_cache, TINY_MODEL, "--data.micro_batches_per_step", "4")
        _close(sharded, single, range(3))
        assert single[0]["train/rewards/margins"] == 0, "step 0: the policy is its reference"
        assert single[2]["train/rewards/margins"] != 0

    def test_lora_uses_the_base_model_as_reference(self, tmp_path, data_cache):
        """Under LoRA the reference is the model with its adapters off (no second copy): at step 0 (``lora_B = 0``)
        policy and reference agree, then the adapters move the rewards."""
        rows, err = _fit(tmp_path, data_cache, TINY_MODEL, "--config", str(ROOT / "callbacks/lora.yaml"),
                         "--model.init_args.objective.rpo_alpha", "0")  # fmt: skip
        assert "reference: adapters_off" in err
        assert math.isclose(rows[0]["train/loss"], math.log(2), rel_tol=1e-6)
        assert rows[2]["train/rewards/margins"] != 0

    def test_moe_with_expert_parallelism_and_checkpointing_resumes_exactly(self, tmp_path, data_cache):
        """Qwen3-MoE, EP 2, activation checkpointing, ``param_dtype: bfloat16`` (as the GPU recipes): 4 steps with a
        checkpoint at step 2; the resumed run logs the uninterrupted run's steps 2 and 3."""
        fragment = FSDP.format(extra="      expert_parallel_size: 2\n      param_dtype: bfloat16\n")
        fragment += "  callbacks:\n    - class_path: xtl.callbacks.ActivationCheckpointing\n"
        every_2 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt"]
        every_2 += ["--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1"]
        steps = ["--trainer.max_steps", "4", "--model.init_args.schedule.decay_steps", "4"]
        full, _ = _fit(tmp_path / "full", data_cache, MOE, *every_2, *steps, fragment=fragment)
        (ckpt,) = (tmp_path / "full/runs/tiny_dpo/ckpt").glob("*step=2.ckpt")
        resumed, _ = _fit(tmp_path / "resumed", data_cache, MOE, *steps, "--ckpt_path", str(ckpt), fragment=fragment)
        assert all(math.isfinite(full[s]["train/loss"]) for s in range(4))
        assert [resumed[s]["train/loss"] for s in (2, 3)] == [full[s]["train/loss"] for s in (2, 3)]
