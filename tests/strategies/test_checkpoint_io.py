"""Crash consistency: runs killed with SIGKILL at random moments resume to the uninterrupted losses; damaged
checkpoints are refused in one line naming the file and the newest intact checkpoint."""

from __future__ import annotations

import contextlib
import csv
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main, _tiny_args
from xtl.strategies.checkpoint_io import checkpoint_problem, recover_interrupted_replace

STEPS = 20
EVERY_STEP = (
    "trainer:\n  val_check_interval: null\n  enable_progress_bar: false\n"
    "  logger:\n    - class_path: lightning.pytorch.loggers.CSVLogger\n"
    "      init_args: {save_dir: ., name: logs, flush_logs_every_n_steps: 1}\n"
    "  callbacks:\n    - class_path: xtl.callbacks.TrainingCheckpoint\n"
    "      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 1, save_top_k: -1}\n"
    "data:\n  val_sources: null\n"
)
FSDP = (
    "trainer:\n  devices: 2\n  precision: 32-true\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n"
    "    init_args: {process_group_backend: gloo}\n"
)


# ``xtl fit`` whose process SIGKILLs itself inside its KILL_AT-th replacement of ``last.ckpt``
DIE_IN_SAVE = """
import os, signal, sys
from xtl.command import main

calls, real = [0], os.replace


def replace(src, dst):
    name = os.path.basename(str(dst))
    if name in ("last.ckpt", ".last.ckpt.old"):
        calls[0] += 1
        if calls[0] == int(os.environ["KILL_AT"]):
            if name.endswith(".old"):
                real(src, dst)  # FSDP: the old directory is moved away, the new one not yet in place
            os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)


os.replace = replace
sys.exit(main())
"""


def _command(work: Path, cache: Path, strategy: str, resume: bool) -> list[str]:
    configs = ["--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(work / "every_step.yaml")]
    if strategy == "fsdp":
        configs += ["--config", str(work / "fsdp.yaml")]
    command = [sys.executable, "-m", "xtl", "fit", *configs, "--trainer.max_steps", str(STEPS)]
    command += ["--data.cache_dir", str(cache), "--data.pack_max_length", "128", *SMALL_MODEL]
    return command + (["--ckpt_path", "last"] if resume else [])


def _losses_per_run(work: Path) -> list[list[tuple[int, str]]]:
    """The ``(step, train/loss)`` rows each run in ``work`` logged, in run order."""
    versions = sorted((work / "runs/tiny_sft/logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    runs = []
    for version in versions:
        rows = csv.DictReader((version / "metrics.csv").open()) if (version / "metrics.csv").is_file() else []
        runs.append([(int(r["step"]), r["train/loss"]) for r in rows if r.get("train/loss")])
    return runs


def _check_resumed(work: Path, want: dict[int, str], kills: int, final_stderr: str = "") -> None:
    """Every logged loss equals the uninterrupted run's; the last run logged every step from where it resumed to
    the end (or, when the last kill came after the final step's save, said that nothing was left to train); each
    kill lost at most the row of the step whose checkpoint it interrupted (a step's state is saved before its row is
    written)."""
    runs = _losses_per_run(work)
    got = [row for run in runs for row in run]
    assert [(step, loss) for step, loss in got if want[step] != loss] == []
    last = [step for step, _ in runs[-1]]
    if last:
        assert last == list(range(last[0], STEPS)) and last[0] > 0, f"the last run did not resume: {last}"
    else:  # tiny steps are fast: the last kill may come after the final step's save
        done = f"the checkpoint is at step {STEPS} and trainer.max_steps is {STEPS}: nothing is left to train"
        assert done in final_stderr, f"the last run trained nothing: {runs}\n{final_stderr[-2000:]}"
    missing = set(range(STEPS)) - {step for step, _ in got}
    assert len(missing) <= kills, sorted(missing)


def _start(work: Path, cache: Path, strategy: str) -> subprocess.Popen:
    resume = (work / "runs/tiny_sft/checkpoints").is_dir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        _command(work, cache, strategy, resume),
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # one process group: the kill reaches Lightning's second rank too
    )


def _logged_steps(work: Path) -> int:
    """How many loss rows the runs in ``work`` have logged so far (a row being written is not counted)."""
    with contextlib.suppress(FileNotFoundError, ValueError, csv.Error):
        return sum(len(run) for run in _losses_per_run(work))
    return 0


def _setup(work: Path) -> None:
    work.mkdir(parents=True)
    (work / "every_step.yaml").write_text(EVERY_STEP)
    (work / "fsdp.yaml").write_text(FSDP)


@pytest.mark.slow
class TestKillAndResume:
    @pytest.fixture(scope="class")
    def uninterrupted(self, tmp_path_factory, data_cache) -> Callable[[str], dict[int, str]]:
        """``uninterrupted(strategy)``: the losses by step of the run without kills (run once per strategy)."""

        @cache
        def losses(strategy: str) -> dict[int, str]:
            work = tmp_path_factory.mktemp(f"uninterrupted_{strategy}") / "full"
            _setup(work)
            proc = _start(work, data_cache, strategy)
            assert proc.wait(timeout=600) == 0, proc.stderr.read()
            want = dict(_losses_per_run(work)[0])
            assert sorted(want) == list(range(STEPS))
            return want

        return losses

    @pytest.mark.parametrize(
        ("strategy", "kills"), [("single", 3), pytest.param("fsdp", 2, marks=pytest.mark.distributed)]
    )
    def test_sigkill_at_random_moments_then_resume_logs_the_uninterrupted_losses(
        self, strategy, kills, tmp_path, data_cache, uninterrupted
    ):
        """Checkpoints every step (a kill lands in a save as often as in a step); each kill comes a random time
        after a run logged its first step (so its checkpoint is complete); the run then resumes from ``last`` until
        it reaches the end."""
        broken = tmp_path / "broken"
        _setup(broken)
        want = uninterrupted(strategy)

        rng = random.Random(0)
        for _ in range(kills):
            logged = _logged_steps(broken)
            proc = _start(broken, data_cache, strategy)
            # a step's row is written after its checkpoint: each run leaves one to resume from, however slow saves are
            while proc.poll() is None and _logged_steps(broken) <= logged:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            assert proc.poll() is None, "the run ended before the kill"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc = _start(broken, data_cache, strategy)
        stderr = proc.communicate(timeout=600)[1]
        assert proc.returncode == 0, stderr[-3000:]
        _check_resumed(broken, want, kills, stderr)

    @pytest.mark.parametrize("strategy", ["single", pytest.param("fsdp", marks=pytest.mark.distributed)])
    def test_a_kill_inside_a_checkpoint_save_resumes_exactly(self, strategy, tmp_path, data_cache, uninterrupted):
        """The run dies at the worst moment of its 5th save of ``last``: single process, with the new file written
        under its temporary name but not renamed; FSDP, between moving the old directory away and moving the new
        one in (``last.ckpt`` is then missing until ``--ckpt_path last`` finishes the replacement)."""
        broken = tmp_path / "broken"
        _setup(broken)
        (broken / "die.py").write_text(DIE_IN_SAVE)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AT": "5"}
        command = _command(broken, data_cache, strategy, resume=False)
        proc = subprocess.Popen(
            [sys.executable, str(broken / "die.py"), *command[3:]], cwd=broken, env=env, start_new_session=True
        )
        assert proc.wait(timeout=600) == -signal.SIGKILL
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # Lightning's second rank, left waiting
        checkpoints = broken / "runs/tiny_sft/checkpoints"
        assert not (checkpoints / "last.ckpt").exists() if strategy == "fsdp" else (checkpoints / "last.ckpt").exists()
        proc = _start(broken, data_cache, strategy)
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
        _check_resumed(broken, uninterrupted(strategy), kills=1)
        assert not list(checkpoints.glob(".*")), "temporary and old copies are gone"


class TestDamagedCheckpoints:
    @pytest.fixture(scope="class")
    def run(self, tmp_path_factory, data_cache) -> Path:
        work = tmp_path_factory.mktemp("damaged")
        (work / "every_step.yaml").write_text(EVERY_STEP)
        args = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(work / "every_step.yaml"))
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(work)
            assert _run_main(["fit", *args, "--trainer.max_steps", "3"]) == 0
        return work

    def _resume(self, run: Path, ckpt: str, capsys, data_cache, monkeypatch) -> str:
        args = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(run / "every_step.yaml"))
        monkeypatch.chdir(run)
        assert _run_main(["fit", *args, "--trainer.max_steps", "5", "--ckpt_path", ckpt]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("xtl: error:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    @pytest.mark.parametrize("damage", ["truncated", "flipped"])
    def test_a_damaged_file_is_named_with_the_newest_intact_one(
        self, run, damage, tmp_path, capsys, data_cache, monkeypatch
    ):
        checkpoints = run / "runs/tiny_sft/checkpoints"
        victim = tmp_path / "epoch=0-step=3.ckpt"
        victim.write_bytes((checkpoints / "epoch=0-step=3.ckpt").read_bytes())
        data = bytearray(victim.read_bytes())
        if damage == "truncated":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 3] ^= 0xFF
        victim.write_bytes(bytes(data))
        assert checkpoint_problem(victim) is not None
        line = self._resume(run, str(victim), capsys, data_cache, monkeypatch)
        assert f"checkpoint {victim} cannot be loaded" in line
        assert "no intact checkpoint is left" in line  # the victim is alone in its folder

    def test_last_names_the_newest_intact_checkpoint(self, run, capsys, data_cache, monkeypatch):
        checkpoints = run / "runs/tiny_sft/checkpoints"
        last = checkpoints / "last.ckpt"
        intact = last.read_bytes()
        try:
            last.write_bytes(intact[:1000])
            line = self._resume(run, "last", capsys, data_cache, monkeypatch)
            assert f"checkpoint {last} cannot be loaded: it is not a complete checkpoint file" in line
            assert f"the newest intact checkpoint there is {checkpoints / 'epoch=0-step=3.ckpt'}" in line
        finally:
            last.write_bytes(intact)

    def test_an_interrupted_directory_replace_is_finished(self, tmp_path):
        (tmp_path / ".last.ckpt.old").mkdir()
        assert recover_interrupted_replace(tmp_path) == [tmp_path / "last.ckpt"]
        assert (tmp_path / "last.ckpt").is_dir() and not (tmp_path / ".last.ckpt.old").exists()
