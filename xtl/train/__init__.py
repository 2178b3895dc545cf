"""The training seam: one LightningModule for every model family, its family records and optimizer configs."""

import importlib

from xtl.train.base import LanguageModule
from xtl.train.family import Family, RouterTraining, family_of
from xtl.train.model_spec import resolve_model_config
from xtl.train.optim import AdamWConfig, MuonConfig, OptimizerConfig, ScheduleConfig, TorchOptimizer
from xtl.train.preference import PreferenceModule
from xtl.train.preference_loss import PreferenceLoss
from xtl.train.reward import RewardModule
from xtl.train.reward_loss import RewardLoss
from xtl.utils import resolve_path

# Modules of earlier releases, folded into LanguageModule: name -> what to write instead.
FOLDED_MODULES = {
    "CausalLM": "model.class_path: xtl.train.LanguageModule",
    "MoECausalLM": (
        "model.class_path: xtl.train.LanguageModule, with balance_loss_coef, z_loss_coef and router_bias_update_lr "
        "under model.init_args.routing (as balance_loss_coef, z_loss_coef, bias_update_lr)"
    ),
    "VisionLM": (
        "model.class_path: xtl.train.LanguageModule, with freeze_<part>: true as model.init_args.freeze: [<part>] "
        "and <part>_lr_scale as model.init_args.optimizer.lr_scales: {<part>: ...}"
    ),
}
FOLDED_MODULES["VisionMoELM"] = FOLDED_MODULES["VisionLM"]


# Imported on first use: the distillation module reaches the rollout engines of xtl.rl, which import xtl.train.
LAZY = {"DistillModule": "xtl.train.distill", "OnPolicySampling": "xtl.train.distill"}


def __getattr__(name: str) -> object:
    if name in LAZY:
        value = getattr(importlib.import_module(LAZY[name]), name)
        globals()[name] = value
        return value
    if name in FOLDED_MODULES:
        raise ImportError(
            f"xtl.train.{name} is gone: one xtl.train.LanguageModule trains every model family; write "
            f"{FOLDED_MODULES[name]}"
        )
    raise AttributeError(f"module 'xtl.train' has no attribute {name!r}")


__all__ = [
    "AdamWConfig",
    "DistillModule",
    "Family",
    "LanguageModule",
    "MuonConfig",
    "OnPolicySampling",
    "OptimizerConfig",
    "PreferenceLoss",
    "PreferenceModule",
    "RewardLoss",
    "RewardModule",
    "RouterTraining",
    "ScheduleConfig",
    "TorchOptimizer",
    "family_of",
    "resolve_model_config",
    "resolve_path",
]
