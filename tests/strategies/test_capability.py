"""Context parallelism as a declared capability: each feature of a run says whether it runs with every sequence split
over ranks, and one check at startup refuses, in one error, every feature that does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import ROOT, SMALL_MODEL
from tests.strategies.test_context_parallel import CP_YAML
from xtl.callbacks import GenerationEval, HFParityCheck, LMEval
from xtl.errors import ConfigError
from xtl.strategies.capability import ContextParallelFeature, Refusal, check_context_parallel
from xtl.strategies.layout import ParallelLayout

CP2 = ParallelLayout(cp=2)
REFUSED = {
    "GenerationEval decodes whole prompts on each process": "drop GenerationEval from trainer.callbacks",
    "HFParityCheck runs whole documents on each process": "drop HFParityCheck from trainer.callbacks",
}


class Counting(ContextParallelFeature):
    """A feature that counts how often it is asked; refuses when given a refusal."""

    def __init__(self, refusal: Refusal | None = None, parts: tuple[ContextParallelFeature, ...] = ()) -> None:
        self.refusal, self.parts, self.asked = refusal, parts, []

    def context_parallel_refusal(self, stage: str) -> Refusal | None:
        self.asked.append(stage)
        return self.refusal

    def context_parallel_parts(self) -> tuple[ContextParallelFeature, ...]:
        return self.parts


class TestCheck:
    def test_without_context_parallelism_no_feature_is_asked(self):
        feature = Counting(Refusal("never"))
        check_context_parallel(ParallelLayout(dp_shard=4), [feature], "fit")
        assert feature.asked == []

    def test_a_feature_that_declares_support_is_not_refused(self):
        """A feature that keeps the default, and an object that declares nothing (a third-party callback), run."""
        supported = Counting()
        check_context_parallel(CP2, [supported, object()], "fit")
        assert supported.asked == ["fit"]

    def test_every_refusal_in_one_line_naming_the_key(self):
        callbacks = [LMEval(tasks=["tiny_choice"]), GenerationEval(), Counting(), HFParityCheck()]  # LMEval runs
        with pytest.raises(ConfigError) as caught:
            check_context_parallel(CP2, callbacks, "fit")
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("trainer.strategy.init_args.context_parallel_size: 2 splits each sequence over 2")
        assert message.endswith("; leave them out, or set context_parallel_size: 1")
        for what, remedy in REFUSED.items():
            assert message.count(what) == 1 and remedy in message, what

    def test_parts_are_asked_with_their_feature_once_each(self):
        part = Counting(Refusal("the part shifts tokens", "set it to 0"))
        owner = Counting(parts=(part,))
        with pytest.raises(ConfigError, match=r"processes, but the part shifts tokens \(set it to 0\); leave it out"):
            check_context_parallel(CP2, [owner], "validate")
        assert owner.asked == part.asked == ["validate"]


@pytest.mark.slow
@pytest.mark.distributed
class TestStartup:
    def test_two_ranks_refuse_every_feature_before_preparing_data(self, tmp_path):
        """``xtl fit`` on 2 processes at ``context_parallel_size: 2`` with two refused callbacks and LMEval (which
        runs under context parallelism): one error line names both refusals, each once, and not LMEval, and the data
        cache is never built (the check runs before ``prepare_data``)."""
        (tmp_path / "cp.yaml").write_text(CP_YAML.format(cp=2))
        command = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs/tiny_sft.yaml")]
        command += ["--config", str(tmp_path / "cp.yaml"), *SMALL_MODEL, "--trainer.devices", "2"]
        for fragment in ("lm_eval.yaml", "eval.yaml", "parity_check.yaml"):  # lm-eval runs under CP
            command += ["--config", str(ROOT / "callbacks" / fragment)]
        command += ["--data.cache_dir", str(tmp_path / "cache")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("xtl: error:")]
        assert errors, proc.stderr[-3000:]
        for what in REFUSED:
            assert errors[0].count(what) == 1, errors[0]
        assert "LMEval" not in errors[0]
        assert "Traceback" not in proc.stderr
        assert not Path(tmp_path / "cache").exists(), "the data was prepared before the refusal"
