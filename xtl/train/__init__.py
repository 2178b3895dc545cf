"""The training seam: one LightningModule for every model family, its family records and optimizer configs."""

from xtl.train.base import LanguageModule
from xtl.train.family import Family, RouterTraining, family_of
from xtl.train.model_spec import resolve_model_config
from xtl.train.optim import AdamWConfig, MuonConfig, OptimizerConfig, ScheduleConfig, TorchOptimizer
from xtl.train.preference import PreferenceModule
from xtl.train.preference_loss import PreferenceLoss
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


def __getattr__(name: str) -> object:
    if name in FOLDED_MODULES:
        raise ImportError(
            f"xtl.train.{name} is gone: one xtl.train.LanguageModule trains every model family; write "
            f"{FOLDED_MODULES[name]}"
        )
    raise AttributeError(f"module 'xtl.train' has no attribute {name!r}")


__all__ = [
    "AdamWConfig",
    "Family",
    "LanguageModule",
    "MuonConfig",
    "OptimizerConfig",
    "PreferenceLoss",
    "PreferenceModule",
    "RouterTraining",
    "ScheduleConfig",
    "TorchOptimizer",
    "family_of",
    "resolve_model_config",
    "resolve_path",
]
