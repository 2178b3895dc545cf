"""Failed judging, said and acted on: a judger that raises or hangs is never silent.

A sample whose judging raises or times out is ``failed`` (:mod:`xtl.rl.judger`): it gets no reward and does not
train. :class:`JudgingFailures` makes that visible, on standard error (rank 0 says it):

- the first failure's text (the judger, the exception's type and message, or its time-out), once per run;
- per training step with failures, one short line: ``xtl: step 3: 12 of 48 samples failed judging (ValueError: ...)``;
- a training step where every judged sample failed for one reason stops the run with a :class:`JudgingError` (a user
  error: the ``xtl`` command prints it in one line, exit code 2) that names the judger, the reason and what to do;
- a validation with failed samples: one line with their count (they are left out of ``val/reward``, and counted as
  ``val/failed``).

:class:`~xtl.rl.GRPOModule` (and the objectives built on it: online DPO, asynchronous and partial rollouts, agent
loops) calls it where judged samples come back: once per rollout batch with the batch's counts summed over the
data-parallel ranks, so every rank takes the same decision, and once per validation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from xtl.errors import UserError
from xtl.rl.judger import TIMED_OUT, BaseJudger

KEY = "model.init_args.judger"
REASON_CHARS = 120  # a reason on a per-step line is cut to this many characters


class JudgingError(UserError):
    """Every sample of a training step failed judging for one reason: the judger cannot score this run."""


class JudgingFailures:
    """Says failed judging on the console and stops a step whose samples all failed for one reason.

    Args:
        judger: The run's judger (named in what is said: :meth:`~xtl.rl.judger.BaseJudger.describe`).
        say: Prints one line (rank 0's standard error; a no-op on the other ranks).
    """

    def __init__(self, judger: BaseJudger, say: Callable[[str], None]) -> None:
        self.judger = judger.describe()
        self.say = say
        self.said_first = False

    def seen(self, errors: Mapping[str, int]) -> None:
        """Say the first failure's text, once per run (``errors``: a failure's error -> its samples)."""
        if errors and not self.said_first:
            self.said_first = True
            self.say(
                f"xtl: judging failed: {self.judger}: {_most_common(errors)} (a sample whose judging fails gets no "
                "reward and does not train; counted per step as rollout/failed)"
            )

    def step(self, step: int, failed: int, judged: int, errors: Mapping[str, int], one_reason: bool) -> None:
        """Account the judging of training step ``step``'s rollout batch.

        Args:
            step: The training step.
            failed: Samples whose judging failed (every data-parallel rank's).
            judged: Samples sent to the judger (every rank's).
            errors: This rank's failures: error -> samples.
            one_reason: Whether each rank's failures share one error.

        Raises:
            JudgingError: Every judged sample failed, for one reason.
        """
        self.seen(errors)
        if failed == 0:
            return
        reason = _most_common(errors) if errors else "on another rank"
        if failed >= judged and one_reason:
            raise JudgingError(self._stop_message(step, judged, reason))
        others = len(errors) - 1
        more = f", and {others} other error{'s' if others > 1 else ''}" if others > 0 else ""
        self.say(f"xtl: step {step}: {failed} of {judged} samples failed judging ({_cut(reason)}{more})")

    def validation(self, failed: int, judged: int, errors: Mapping[str, int]) -> None:
        """Say how many held-out samples failed judging (left out of ``val/reward``)."""
        self.seen(errors)
        if failed:
            reason = f" ({_cut(_most_common(errors))})" if errors else ""
            self.say(
                f"xtl: validation: {failed} of {judged} samples failed judging{reason}; val/reward is the mean over "
                "the others" + (" (none: it is NaN)" if failed >= judged else "")
            )

    def _stop_message(self, step: int, judged: int, reason: str) -> str:
        if reason.startswith(TIMED_OUT):
            what = (
                f"make it answer faster, or give it longer: {KEY}.init_args.timeout_s (a hung call holds one of its "
                "threads until it returns)"
            )
        else:
            what = (
                "fix the judger (call it by hand on a response and its ground truth); a FunctionJudger's function is "
                "called as fn(response, ground_truth, **extra) and returns a float or {'score': float}"
            )
        return (
            f"every one of the {judged} samples of step {step} failed judging, so nothing trains: {self.judger}: "
            f"{_cut(reason, 400)}; {what}"
        )


# ---- private ---------------------------------------------------------------------------------------------------


def _most_common(errors: Mapping[str, int]) -> str:
    return max(errors.items(), key=lambda item: item[1])[0]


def _cut(text: str, chars: int = REASON_CHARS) -> str:
    text = " ".join(text.split())  # one line
    return text if len(text) <= chars else text[: chars - 3] + "..."
