"""Evaluation on sharded ranks: at the tail of a held-out set ranks hold different numbers of packs, yet every rank
runs as many forwards (FSDP gathers parameters in each), and the metrics equal one process's."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inprocess import run_in_process
from tests.train.conftest import TINY_MODEL
from xtl.data import XTLDataModule

ROOT = Path(__file__).resolve().parents[2]
PACK = 128


def _val(work: Path, cache: Path, *extra: str) -> dict[str, float]:
    """``val/*`` of a one-step ``xtl fit`` of the tiny SFT recipe (validation after the step) in ``work``."""
    work.mkdir()
    args = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs/tiny_sft.yaml")]
    args += ["--model.init_args.model", str(TINY_MODEL).replace("'", '"').replace("True", "true")]
    args += ["--trainer.precision", "32-true", "--trainer.val_check_interval", "1", "--trainer.max_steps", "1"]
    args += ["--data.pack_max_length", str(PACK), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.callbacks", "[]", "--data.cache_dir", str(cache), *extra]
    if "--trainer.devices" in extra:  # a second rank is started by re-running the command line
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        code, output = proc.returncode, proc.stderr
    else:
        code, output = run_in_process(args[3:], work)
    assert code == 0, output[-3000:]
    assert "sync_dist" not in output, "a warning a user cannot act on"
    (metrics,) = work.glob("runs/tiny_sft/logs/version_*/metrics.csv")
    (row,) = [r for r in csv.DictReader(metrics.open()) if r.get("val/loss")]
    return {k: float(v) for k, v in row.items() if k.startswith("val/") and v}


@pytest.mark.slow
@pytest.mark.distributed
class TestShardedEvaluation:
    def test_an_uneven_tail_on_two_fsdp_ranks_equals_one_process(self, tmp_path, data_cache):
        """2 ranks x 2 packs per step: the last step leaves rank 1 fewer packs than rank 0 (it forwards fillers)."""
        datamodule = XTLDataModule(
            sources=[{"path": "tiny:sft_train.jsonl"}], val_sources={"heldout": [{"path": "tiny:sft_eval.jsonl"}]},
            tokenizer="tiny:", pack_max_length=PACK, cache_dir=str(data_cache), progress=False,
        )  # fmt: skip
        datamodule.setup("validate")
        packs = len(datamodule.val_splits["heldout"].packs)
        assert packs % 4 in (1, 2), f"{packs} held-out packs: choose a pack length that leaves an uneven tail"
        fsdp = ["--trainer.devices", "2", "--trainer.strategy", "xtl.strategies.FSDPStrategy"]
        fsdp += ["--trainer.strategy.init_args.process_group_backend", "gloo"]
        sharded = _val(tmp_path / "fsdp", data_cache, *fsdp)
        single = _val(tmp_path / "one", data_cache, "--data.micro_batches_per_step", "4")
        assert sharded == pytest.approx(single, rel=1e-5)
