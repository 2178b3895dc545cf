"""Reinforcement learning: the judgers that score rollouts (:mod:`xtl.rl.judger`)."""

from xtl.rl.judger import (
    BaseJudger,
    ComposedJudger,
    ExactMatchJudger,
    FormatJudger,
    FunctionJudger,
    Judger,
    MathJudger,
    RegexJudger,
    RolloutState,
    SyncJudger,
)

__all__ = [
    "BaseJudger",
    "ComposedJudger",
    "ExactMatchJudger",
    "FormatJudger",
    "FunctionJudger",
    "Judger",
    "MathJudger",
    "RegexJudger",
    "RolloutState",
    "SyncJudger",
]
