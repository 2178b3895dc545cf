"""Failed judging is visible and never holds the run: a hung judger does not keep the process alive, failures are said
on the console and counted per step, a step whose judging all failed for one reason stops the run, and validation
leaves failed samples out of ``val/reward``."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

from tests.inprocess import run_in_process
from tests.rl.test_module import MODEL, _datamodule, _fit, _module, varied_reward
from xtl.rl import BaseJudger, FunctionJudger, JudgingError
from xtl.rl.daemon_pool import DaemonThreadPool
from xtl.rl.failures import JudgingFailures

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 3 * 4  # _module's rollout batch: 3 prompts x 4 completions
_HUNG = itertools.count()


def raising(response: str, ground_truth: str) -> float:
    """A judger function that always raises."""
    raise ValueError("no answer here")


def hang_first(response: str, ground_truth: str) -> float:
    """The first call never returns (in time); the others score as :func:`varied_reward`."""
    if next(_HUNG) == 0:
        time.sleep(3600)
    return varied_reward(response, ground_truth)


def hang_all(response: str, ground_truth: str) -> float:
    """Every call hangs for longer than the judger's time-out."""
    time.sleep(2)
    return 0.0


class EveryThirdRaises:
    """Raises on every third call (4 of a batch of 12), scores the others as :func:`varied_reward`."""

    def __init__(self) -> None:
        self.calls = itertools.count()  # next() is atomic: the scoring threads each get their own number

    def __call__(self, response: str, ground_truth: str) -> float:
        if next(self.calls) % 3 == 2:
            raise KeyError("missing field")
        return varied_reward(response, ground_truth)


class OddFails(BaseJudger):
    """Scores 1 the even states of each call and fails the odd ones (``every``: fails all)."""

    def __init__(self, every: bool = False) -> None:
        self.every = every

    async def batch_judge(self, states):
        for i, state in enumerate(states):
            if self.every or i % 2:
                state.status, state.reward, state.error = "failed", None, "RuntimeError: judge down"
            else:
                state.reward = {"score": 1.0}
        return list(states)


def _override(work: Path, judger: str, steps: int = 2) -> list[str]:
    """``xtl fit`` of the tiny GRPO recipe with the tiny random policy, ``steps`` steps and ``judger`` (YAML)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "override.yaml").write_text(
        f"trainer:\n  max_steps: {steps}\n  precision: 32-true\n  val_check_interval: null\n  limit_val_batches: 0\n"
        "  enable_progress_bar: false\n  callbacks: []\n  logger: false\n"
        f"model:\n  init_args:\n    model: {json.dumps(MODEL)}\n    judger: {judger}\n"
        "    sampling: {group_size: 4, max_new_tokens: 6}\n"
        "    rollout: {prompts_per_step: 3, dynamic_sampling: false, oversample: 1.0}\n"
    )
    return ["fit", "--config", str(ROOT / "configs" / "tiny_grpo.yaml"), "--config", str(work / "override.yaml")]


def _function_judger(name: str, timeout_s: float) -> str:
    path = f"tests.rl.test_judger_failures:{name}"
    return f"{{class_path: xtl.rl.FunctionJudger, init_args: {{fn: '{path}', timeout_s: {timeout_s}}}}}"


class TestDaemonThreadPool:
    def test_results_exceptions_and_cancelled_calls(self) -> None:
        pool = DaemonThreadPool(1, "test")
        gate = threading.Event()
        first = pool.submit(gate.wait, 5)
        queued = pool.submit(lambda: pytest.fail("a call cancelled while queued must not run"))
        assert queued.cancel()
        failing = pool.submit(int, "x")
        gate.set()
        assert first.result(timeout=5) is True
        with pytest.raises(ValueError, match="invalid literal"):
            failing.result(timeout=5)
        assert len(pool._workers) == 1 and all(w.daemon for w in pool._workers)

    def test_threads_are_reused_up_to_the_limit(self) -> None:
        pool = DaemonThreadPool(2, "test")
        for _ in range(5):
            assert pool.submit(sum, [1, 2]).result(timeout=5) == 3
        assert len(pool._workers) == 1, "an idle thread takes the next call"
        gate = threading.Event()
        held = [pool.submit(gate.wait, 5) for _ in range(4)]
        assert len(pool._workers) == 2
        gate.set()
        assert all(f.result(timeout=5) for f in held)

    @pytest.mark.parametrize("in_a_loop", [False, True], ids=["plain", "running_event_loop"])
    def test_a_hung_judger_does_not_keep_the_process_alive(self, in_a_loop: bool) -> None:
        """A process whose judger call never returns fails that sample after ``timeout_s`` and exits (with a
        ``ThreadPoolExecutor``, the interpreter would join the hung thread at exit: forever)."""
        judge = "judger.judge_sync([RolloutState('a', '1')])"
        call = (
            f"async def main():\n    return {judge}\nstate, = asyncio.run(main())"
            if in_a_loop
            else f"state, = {judge}"
        )
        script = (
            "import asyncio, time\nfrom xtl.rl.judger import FunctionJudger, RolloutState\n"
            "judger = FunctionJudger(lambda response, truth: time.sleep(3600), timeout_s=0.3)\n"
            f"{call}\nprint(state.status, state.error)\n"
        )
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "failed the judger did not answer within 0.3 s"
        assert time.monotonic() - began < 60


class TestJudgingFailures:
    def test_the_first_failure_is_said_once_then_a_line_per_step(self) -> None:
        lines: list[str] = []
        failures = JudgingFailures(FunctionJudger(raising), lines.append)
        failures.step(0, 0, 12, {}, True)
        assert lines == []
        failures.step(1, 4, 12, {"ValueError: no answer here": 4}, True)
        failures.step(2, 5, 12, {"ValueError: no answer here": 3, "KeyError: 'x'": 2}, False)
        assert lines == [
            "xtl: judging failed: FunctionJudger (tests.rl.test_judger_failures:raising): ValueError: no answer here "
            "(a sample whose judging fails gets no reward and does not train; counted per step as rollout/failed)",
            "xtl: step 1: 4 of 12 samples failed judging (ValueError: no answer here)",
            "xtl: step 2: 5 of 12 samples failed judging (ValueError: no answer here, and 1 other error)",
        ]

    def test_a_long_error_is_cut_on_one_line(self) -> None:
        lines: list[str] = []
        JudgingFailures(OddFails(), lines.append).step(3, 1, 12, {"E: " + "x\n" * 400: 1}, True)
        assert len(lines) == 2 and "\n" not in lines[1] and len(lines[1]) < 200 and lines[1].endswith("...)")

    def test_a_step_whose_judging_all_failed_for_one_reason_stops(self) -> None:
        failures = JudgingFailures(FunctionJudger(raising), lambda line: None)
        with pytest.raises(JudgingError, match=r"every one of the 12 samples of step 4 failed judging.*fn\(response"):
            failures.step(4, 12, 12, {"ValueError: no answer here": 12}, True)
        failures.step(5, 12, 12, {"ValueError: a": 6, "KeyError: b": 6}, False)  # several reasons: no stop
        failures.step(6, 12, 12, {"ValueError: a": 6}, False)  # several on another rank: no stop
        timeout = "the judger did not answer within 0.5 s"
        with pytest.raises(JudgingError, match=r"did not answer within 0\.5 s; make it answer faster.*timeout_s"):
            failures.step(7, 12, 12, {timeout: 12}, True)


class TestTraining:
    def test_only_rank_0_says_it(self, capsys, monkeypatch) -> None:
        module = _module()
        module._say("xtl: rank 0")
        monkeypatch.setattr(type(module), "global_rank", property(lambda self: 1))
        module._say("xtl: rank 1")
        assert capsys.readouterr().err == "xtl: rank 0\n"

    def test_a_partly_failing_judger_is_said_and_the_run_goes_on(self, tmp_path, capsys) -> None:
        steps, _ = _fit(_module(judger=FunctionJudger(EveryThirdRaises())), 4, tmp_path)
        err = capsys.readouterr().err
        assert err.count("xtl: judging failed: FunctionJudger") == 1 and "KeyError: 'missing field'" in err
        for step in (0, 2):  # a rollout batch every two steps (2 mini-batches)
            assert f"xtl: step {step}: 4 of {SAMPLES} samples failed judging (KeyError: 'missing field')" in err
        assert "xtl: step 1:" not in err, "a line per rollout batch with failures"
        assert steps[1]["rollout/failed"] == 4 and all(math.isfinite(steps[s]["train/loss"]) for s in (1, 2, 3, 4))

    def test_a_judger_that_always_raises_stops_the_run_with_exit_2(self, tmp_path) -> None:
        code, output = run_in_process(_override(tmp_path, _function_judger("raising", 5)), tmp_path)
        assert code == 2, output[-3000:]
        assert "Traceback" not in output
        judger = "FunctionJudger (tests.rl.test_judger_failures:raising)"
        assert f"xtl: judging failed: {judger}: ValueError: no answer here" in output
        (error,) = [line for line in output.splitlines() if line.startswith("xtl: error:")]
        said = f"every one of the {SAMPLES} samples of step 0 failed judging, so nothing trains: {judger}: ValueError"
        assert error.startswith(f"xtl: error: {said}: no answer here; fix the judger")
        assert "fn(response, ground_truth, **extra)" in error

    def test_a_judger_that_never_answers_in_time_stops_the_run(self, tmp_path) -> None:
        code, output = run_in_process(_override(tmp_path, _function_judger("hang_all", 0.3)), tmp_path)
        assert code == 2, output[-3000:]
        (error,) = [line for line in output.splitlines() if line.startswith("xtl: error:")]
        assert "the judger did not answer within 0.3 s; make it answer faster" in error and "timeout_s" in error

    def test_a_run_with_a_hung_judger_exits(self, tmp_path) -> None:
        """``xtl fit`` in a process of its own, whose judger's first call hangs for an hour (``timeout_s: 0.5``):
        that sample fails, the run trains its steps and the process exits (the hung scoring thread is a daemon)."""
        args = _override(tmp_path, _function_judger("hang_first", 0.5))
        env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "xtl", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-3000:]
        assert "`Trainer.fit` stopped" in output
        assert f"xtl: step 0: 1 of {SAMPLES} samples failed judging (the judger did not answer within 0.5 s)" in output
        assert time.monotonic() - began < 180


class TestValidation:
    def _validate(self, tmp_path, judger):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             default_root_dir=tmp_path, limit_val_batches=1)  # fmt: skip
        return trainer.validate(_module(judger=judger), datamodule=_datamodule(val=True), verbose=False)[0]

    def test_failed_samples_are_left_out_of_the_reward_and_counted(self, tmp_path, capsys) -> None:
        metrics = self._validate(tmp_path, OddFails())
        assert metrics["val/reward"] == 1.0, "the mean over the scored samples, not diluted by the failed ones"
        count = 16  # predict_batch_size, one batch
        assert metrics["val/failed"] == count // 2
        err = capsys.readouterr().err
        assert f"xtl: validation: {count // 2} of {count} samples failed judging (RuntimeError: judge down)" in err

    def test_every_sample_failing_is_not_a_reward_of_zero(self, tmp_path, capsys) -> None:
        metrics = self._validate(tmp_path, OddFails(every=True))
        assert math.isnan(metrics["val/reward"]) and metrics["val/failed"] == 16
        assert "(none: it is NaN)" in capsys.readouterr().err
