"""Ctrl-C and SIGTERM save ``last`` at the step reached before the fit exits, and a failure after the final step
finds ``last`` saved: ``--ckpt_path last`` then resumes with no step lost."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.cli.test_auto_resume import FSDP_EVERY_2, _torchrun_fit
from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main, _tiny_args
from tests.train.test_step import _free_port
from xtl.callbacks import TrainingCheckpoint

# a fixed schedule (a run's learning rates do not depend on its max_steps), no validation, the CSV flushed each step
PLAIN = """\
trainer:
  val_check_interval: null
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args: {save_dir: ., name: logs, flush_logs_every_n_steps: 1}
  callbacks:
    - class_path: xtl.callbacks.TrainingCheckpoint
      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 100, save_top_k: -1}
model:
  init_args:
    schedule: {warmup_steps: 2, decay_steps: 40}
data:
  val_sources: null
"""
RUN = Path("runs/tiny_sft")
LAST = RUN / "checkpoints/last.ckpt"


class SignalSelf(pl.Callback):
    """Send this process ``signal`` (``times`` times) in the middle of step ``step`` (before its optimizer step), or
    with ``in_validation`` in the validation after step ``step``."""

    def __init__(
        self, step: int, signal: str = "SIGTERM", times: int = 1, rank: int | None = None, in_validation: bool = False
    ) -> None:
        self.step, self.signal, self.times, self.rank, self.in_validation = step, signal, times, rank, in_validation

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self.in_validation:
            self._send(trainer)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if self.in_validation:
            self._send(trainer)

    def _send(self, trainer: pl.Trainer) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            for _ in range(self.times):
                os.kill(os.getpid(), getattr(signal, self.signal))
            self.times = 0


class FailAtTrainEnd(pl.Callback):
    """Fail in ``on_train_end``, as a failing HF export or evaluation at the end of training would."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise RuntimeError("the export failed")


def _callback(cls: type, **init_args: Any) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": f"{__name__}.{cls.__name__}", "init_args": init_args})


def _losses(run: Path) -> list[dict[int, str]]:
    """The training losses each fit of the run logged, by step (one dict per log version)."""
    versions = sorted(run.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    return [
        {int(r["step"]): r["train/loss"] for r in csv.DictReader(m.open()) if r.get("train/loss")} for m in versions
    ]


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


@pytest.fixture
def args(tmp_path, monkeypatch, data_cache) -> list[str]:
    """``xtl fit`` of the tiny recipe in ``tmp_path`` (small model, fixed schedule, no validation)."""
    monkeypatch.chdir(tmp_path)
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "plain.yaml").write_text(PLAIN)
    return ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", "plain.yaml")]


@pytest.fixture
def saves(monkeypatch) -> list[tuple[str, int]]:
    """Every checkpoint ``TrainingCheckpoint`` saves: (file name, global step)."""
    seen: list[tuple[str, int]] = []
    original = TrainingCheckpoint._save_checkpoint

    def spy(self: TrainingCheckpoint, trainer: pl.Trainer, filepath: str) -> None:
        seen.append((Path(filepath).name, trainer.global_step))
        original(self, trainer, filepath)

    monkeypatch.setattr(TrainingCheckpoint, "_save_checkpoint", spy)
    return seen


class TestFinalStepSavedFirst:
    @pytest.mark.parametrize(
        "extra",
        [
            (),
            ("--data.micro_batches_per_step", "3"),  # xtl accumulates in its step (manual optimization)
            (
                "--trainer.val_check_interval",
                "3",
                "--data.val_sources",
                '{"heldout": [{"path": "tiny:sft_eval.jsonl", "kind": "chat"}]}',
                "--trainer.limit_val_batches",
                "1",
            ),
        ],
        ids=["plain", "accumulation", "validation-at-the-end"],
    )
    def test_a_failure_in_on_train_end_finds_last_saved_at_the_final_step_once(self, args, saves, extra):
        with pytest.raises(RuntimeError, match="the export failed"):
            _run_main([*args, "--trainer.max_steps", "3", *extra, _callback(FailAtTrainEnd)])
        assert _step(LAST) == 3
        assert saves == [("last.ckpt", 3)], "last is saved once, at the final step"

    def test_the_fit_ending_normally_saves_last_once_per_step(self, args, saves, tmp_path):
        assert _run_main([*args, "--trainer.max_steps", "3"]) == 0
        assert saves == [("last.ckpt", 3)]
        (tmp_path / "every2.yaml").write_text(PLAIN.replace("every_n_train_steps: 100", "every_n_train_steps: 2"))
        saves.clear()
        every2 = [*args, "--config", "every2.yaml", "--trainer.default_root_dir", "runs/every2"]
        assert _run_main([*every2, "--trainer.max_steps", "4"]) == 0
        assert _run_main([*every2, "--trainer.max_steps", "5", "--ckpt_path", "last"]) == 0
        periodic = [("epoch=0-step=2.ckpt", 2), ("last.ckpt", 2), ("epoch=0-step=4.ckpt", 4), ("last.ckpt", 4)]
        assert saves == [*periodic, ("last.ckpt", 5)]


class TestSignalsInProcess:
    def test_sigterm_mid_step_saves_last_at_the_step_reached_and_exits_143(self, args, capsys, saves):
        """SIGTERM in step 3 (global_step 2, before its optimizer step): the step completes, last is saved at 3, and
        the resumed fit logs the losses of an uninterrupted run."""
        assert _run_main([*args, "--trainer.max_steps", "6", _callback(SignalSelf, step=2)]) == 143
        err = capsys.readouterr().err
        assert "xtl: interrupted (SIGTERM) at step 2; saving last.ckpt after the step in progress\n" in err
        assert (
            f"xtl: saved {LAST.resolve()} at step 3; exiting with 143 (SIGTERM); resume with --ckpt_path last" in err
        )
        assert _step(LAST) == 3 and saves == [("last.ckpt", 3)]
        assert _run_main([*args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
        first, resumed = _losses(RUN)
        assert sorted(first) == [0, 1, 2] and sorted(resumed) == [3, 4, 5]

        full = Path("full").resolve()
        full.mkdir()
        (full / "plain.yaml").write_text(PLAIN)
        os.chdir(full)
        assert _run_main([*args, "--trainer.max_steps", "6"]) == 0
        (expected,) = _losses(RUN)
        assert {**first, **resumed} == expected

    def test_ctrl_c_during_validation_stops_after_it_without_another_step(self, args, capsys, saves):
        """SIGINT in the validation after step 2: last is saved at step 2 when the validation ends (no step 3)."""
        val = ["--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2", "--data.val_sources"]
        val += ['{"heldout": [{"path": "tiny:sft_eval.jsonl", "kind": "chat"}]}']
        stop = _callback(SignalSelf, step=2, signal="SIGINT", in_validation=True)
        assert _run_main([*args, *val, "--trainer.max_steps", "6", stop]) == 130
        err = capsys.readouterr().err
        assert "xtl: interrupted (SIGINT) at step 2; saving last.ckpt after the step in progress (Ctrl-C again" in err
        assert f"xtl: saved {LAST.resolve()} at step 2; exiting with 130 (SIGINT)" in err
        assert _step(LAST) == 2 and saves == [("last.ckpt", 2)]
        assert sorted(_losses(RUN)[0]) == [0, 1]

    def test_with_save_last_link_last_is_the_step_reached_not_a_link_to_an_earlier_checkpoint(self, args, tmp_path):
        config = PLAIN.replace("save_last: true, every_n_train_steps: 100", "save_last: link, every_n_train_steps: 2")
        (tmp_path / "link.yaml").write_text(config)
        stop = _callback(SignalSelf, step=2)
        assert _run_main([*args, "--config", "link.yaml", "--trainer.max_steps", "6", stop]) == 143
        assert not LAST.is_symlink() and _step(LAST) == 3

    def test_a_second_ctrl_c_stops_at_once_without_saving(self, args, capsys, saves):
        assert (
            _run_main([*args, "--trainer.max_steps", "6", _callback(SignalSelf, step=2, signal="SIGINT", times=2)])
            == 1
        )
        err = capsys.readouterr().err
        assert "xtl: interrupted (SIGINT) at step 2; saving last.ckpt after the step in progress (Ctrl-C again" in err
        assert saves == [] and not LAST.exists()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the handlers are given back"


class TestCtrlCSubprocess:
    def test_ctrl_c_saves_last_at_the_step_reached_and_ckpt_path_last_resumes_from_it(self, args, tmp_path):
        """A real ``xtl fit`` process gets SIGINT once it has logged 2 steps; it exits 130 with last.ckpt at the
        step it reached (the steps it logged), and a resume continues from there with an uninterrupted run's losses."""
        command = [sys.executable, "-m", "xtl", *args, "--trainer.max_steps", "400"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        metrics = tmp_path / RUN / "logs/version_0/metrics.csv"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(_losses(tmp_path / RUN)[0]) >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err[-3000:]
        (logged,) = _losses(tmp_path / RUN)
        reached = max(logged) + 1
        assert _step(tmp_path / LAST) == reached
        assert "xtl: interrupted (SIGINT) at step " in err
        assert f"at step {reached}; exiting with 130 (SIGINT); resume with --ckpt_path last" in err

        end = reached + 2
        assert _run_main([*args, "--trainer.max_steps", str(end), "--ckpt_path", "last"]) == 0
        first, resumed = _losses(tmp_path / RUN)
        assert sorted(resumed) == [reached, reached + 1]
        full = tmp_path / "full"
        full.mkdir()
        (full / "plain.yaml").write_text(PLAIN)
        os.chdir(full)
        assert _run_main([*args, "--trainer.max_steps", str(end)]) == 0
        (expected,) = _losses(full / RUN)
        assert {**first, **resumed} == expected


@pytest.mark.slow
@pytest.mark.distributed
class TestSigtermFSDP:
    def test_sigterm_on_one_rank_stops_both_at_the_next_step_with_a_collective_save(self, tmp_path, data_cache):
        """torchrun, 2 FSDP ranks on gloo (a DCP checkpoint every 2 steps); only rank 1 gets SIGTERM, in step 3.
        Both ranks agree at the step boundary, save ``last`` (a DCP directory, every rank writing its shard) at step
        3 -- not the step-2 periodic one -- and exit 143; the watchdog names no rank (every rank is alive)."""
        signal_rank1 = {"class_path": f"{__name__}.SignalSelf", "init_args": {"step": 2, "rank": 1}}
        launch = ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
        proc = _torchrun_fit(
            tmp_path, data_cache, *launch, extra=(f"--trainer.callbacks+={json.dumps(signal_rank1)}",)
        )
        log = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "exitcode: 143" in log, log[-6000:]
        assert "xtl: interrupted (SIGTERM on another rank) at step 3; saving last.ckpt" in log, log[-6000:]
        assert "xtl: error:" not in log and "stopped heartbeating" not in log, log[-6000:]
        last = tmp_path / "runs/tiny_sft/checkpoints/last.ckpt"
        assert last.is_dir() and _step(last / "meta.pt") == 3
        assert _step(tmp_path / "runs/tiny_sft/checkpoints/epoch=0-step=2.ckpt/meta.pt") == 2
        (logged,) = _losses(tmp_path / "runs/tiny_sft")
        assert sorted(logged) == [0, 1, 2], "the interrupted step's loss is logged"

    def test_torchruns_sigterm_to_every_live_rank_saves_last_at_the_step_reached(self, tmp_path, data_cache):
        """SIGTERM to the torchrun agent (a job stopped or preempted): it sends SIGTERM to both workers, each at its
        own moment; they stop together at a step boundary with ``last`` at the step reached (the steps logged), and
        the watchdog names no rank."""
        (tmp_path / "fsdp.yaml").write_text(FSDP_EVERY_2)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr"]
        command += ["127.0.0.1", "--master-port", str(_free_port()), "-m", "xtl", "fit", "--config"]
        command += [str(ROOT / "configs/tiny_sft.yaml"), "--config", "fsdp.yaml", *SMALL_MODEL, "--data.cache_dir"]
        command += [str(data_cache), "--data.pack_max_length", "128", "--trainer.max_steps", "400"]
        command += ["--trainer.devices", "2"]
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")}
        env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with (tmp_path / "log.txt").open("w") as out:
            agent = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
            run = tmp_path / "runs/tiny_sft"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and agent.poll() is None:
                if list(run.glob("logs/version_0/metrics.csv")) and len(_losses(run)[0]) >= 2:
                    break
                time.sleep(0.05)
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=60)
        log = (tmp_path / "log.txt").read_text()
        assert agent.returncode != 0 and "xtl: interrupted (SIGTERM) at step " in log, log[-6000:]
        assert "xtl: error:" not in log and "stopped heartbeating" not in log, log[-6000:]
        (logged,) = _losses(run)
        reached = max(logged) + 1
        assert f"at step {reached}; exiting with 143 (SIGTERM); resume with --ckpt_path last" in log, log[-6000:]
        assert _step(run / "checkpoints/last.ckpt/meta.pt") == reached
