"""Reinforcement learning: judgers (:mod:`xtl.rl.judger`), rollout engines (:mod:`xtl.rl.rollout`) and the choice of
one (:mod:`xtl.rl.engines`), the replay buffer (:mod:`xtl.rl.buffer`), the policy losses (:mod:`xtl.rl.loss`),
rollout packing (:mod:`xtl.rl.packing`), :class:`GRPOModule` (:mod:`xtl.rl.module`) with its grouped settings
(:mod:`xtl.rl.settings`) and Ray actors for rollout and judging (:mod:`xtl.rl.remote`, imported on use: ``from
xtl.rl.remote import RayJudger``)."""

from xtl.rl.engines import EngineSettings
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
from xtl.rl.settings import RolloutSettings, UpdateSettings

__all__ = [
    "BaseJudger",
    "ComposedJudger",
    "EngineSettings",
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
    "RolloutSettings",
    "RolloutState",
    "SamplingSettings",
    "SyncJudger",
    "UpdateSettings",
    "VLLMRolloutEngine",
    "VLLMSettings",
]
