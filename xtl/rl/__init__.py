"""Reinforcement learning: judgers (:mod:`xtl.rl.judger`), rollout engines (:mod:`xtl.rl.rollout`) and the choice of
one (:mod:`xtl.rl.engines`), agent loops (:mod:`xtl.rl.agent`: multi-turn tools, environments, black-box agents),
the replay buffer (:mod:`xtl.rl.buffer`), the policy losses (:mod:`xtl.rl.loss`), rollout packing
(:mod:`xtl.rl.packing`), :class:`GRPOModule` (:mod:`xtl.rl.module`) with its grouped settings
(:mod:`xtl.rl.settings`) and Ray actors for rollout and judging (:mod:`xtl.rl.remote`, imported on use: ``from
xtl.rl.remote import RayJudger``).

The names below are imported on first use: a process that needs one judger (a Ray judging actor, a tool's
subprocess) does not import Lightning and the trainer with it.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "BaseJudger": "xtl.rl.judger",
    "ComposedJudger": "xtl.rl.judger",
    "ExactMatchJudger": "xtl.rl.judger",
    "FormatJudger": "xtl.rl.judger",
    "FunctionJudger": "xtl.rl.judger",
    "Judger": "xtl.rl.judger",
    "MathJudger": "xtl.rl.judger",
    "RegexJudger": "xtl.rl.judger",
    "RolloutState": "xtl.rl.judger",
    "SyncJudger": "xtl.rl.judger",
    "RewardModelJudger": "xtl.rl.reward_model_judger",
    "JudgingError": "xtl.rl.failures",
    "EngineSettings": "xtl.rl.engines",
    "PolicyLossConfig": "xtl.rl.loss",
    "GRPOModule": "xtl.rl.module",
    "OnlineDPOModule": "xtl.rl.online_dpo",
    "DetachedEngine": "xtl.rl.rollout",
    "LocalRolloutEngine": "xtl.rl.rollout",
    "Rollout": "xtl.rl.rollout",
    "RolloutEngine": "xtl.rl.rollout",
    "SamplingSettings": "xtl.rl.rollout",
    "VLLMRolloutEngine": "xtl.rl.rollout",
    "VLLMSettings": "xtl.rl.rollout",
    "RolloutSettings": "xtl.rl.settings",
    "UpdateSettings": "xtl.rl.settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xtl.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
