"""Reinforcement learning: judgers (:mod:`xtl.rl.judger`), rollout engines (:mod:`xtl.rl.rollout`), the replay
buffer (:mod:`xtl.rl.buffer`), the policy losses (:mod:`xtl.rl.loss`), :class:`GRPOModule` (:mod:`xtl.rl.module`)
and Ray actors for rollout and judging (:mod:`xtl.rl.remote`, imported on use: ``from xtl.rl.remote import
RayJudger``)."""

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
from xtl.rl.loss import PolicyLossConfig
from xtl.rl.module import GRPOModule
from xtl.rl.rollout import (
    LocalRolloutEngine,
    Rollout,
    RolloutEngine,
    SamplingSettings,
    VLLMRolloutEngine,
    VLLMSettings,
)

__all__ = [
    "BaseJudger",
    "ComposedJudger",
    "ExactMatchJudger",
    "FormatJudger",
    "FunctionJudger",
    "GRPOModule",
    "LocalRolloutEngine",
    "Judger",
    "MathJudger",
    "PolicyLossConfig",
    "RegexJudger",
    "Rollout",
    "RolloutEngine",
    "RolloutState",
    "SamplingSettings",
    "SyncJudger",
    "VLLMRolloutEngine",
    "VLLMSettings",
]
