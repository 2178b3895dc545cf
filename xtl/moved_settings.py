"""Settings of earlier releases that moved: one message naming what to write instead, before any parsing.

A recipe written for an earlier xtl stops with ``xtl: error: <file>: <key> ... write <new key>`` (exit 2) instead of
an unknown-key error or a class it cannot import. :func:`moved_setting_error` checks the command line and every
``--config`` file against the tables below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from xtl.rl.settings import moved_key as moved_rl_key
from xtl.train import FOLDED_MODULES

# model.init_args key -> where it went (under model.init_args); GRPOModule's flat keys: xtl.rl.settings.MOVED_KEYS
MOVED_MODEL_KEYS = {
    "lr": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "betas": "optimizer.betas",
    "eps": "optimizer.eps",
    "no_decay_norm_bias_embed": "optimizer.no_decay_norm_bias_embed",
    "lr_schedule": "schedule.kind",
    "warmup_steps": "schedule.warmup_steps",
    "min_lr_ratio": "schedule.min_lr_ratio",
    "lr_decay_steps": "schedule.decay_steps",
    "balance_loss_coef": "routing.balance_loss_coef",
    "z_loss_coef": "routing.z_loss_coef",
    "router_bias_update_lr": "routing.bias_update_lr",
    "freeze_vision": "freeze (a list of parts: freeze: [vision])",
    "freeze_merger": "freeze (a list of parts: freeze: [merger])",
    "freeze_language": "freeze (a list of parts: freeze: [language])",
    "vision_lr_scale": "optimizer.lr_scales.vision",
    "merger_lr_scale": "optimizer.lr_scales.merger",
    "language_lr_scale": "optimizer.lr_scales.language",
}
# (callback class name, init_args key) -> what to write instead
MOVED_CALLBACK_KEYS = {
    ("LoRA", "quantize_base"): "QLoRA is its own callback: drop quantize_base and add --config callbacks/qlora.yaml",
    ("LoRA", "quantize_all_linear"): "it is an argument of the QLoRA callback (callbacks/qlora.yaml)",
    ("HFExport", "lora"): "what a LoRA model exports is the LoRA callback's export: merged | adapter | both",
}


def moved_setting_error(argv: list[str]) -> str | None:
    """A message naming the new setting when ``argv`` or one of its ``--config`` files uses a moved one."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv) or arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1] if "=" in arg else argv[i + 1])
            found = _moved_in_yaml(path)
            if found:
                return f"{path}: {found}"
        elif arg.startswith("--model."):
            key, _, value = arg[2:].partition("=")
            if key == "model.class_path":
                value = value or (argv[i + 1] if i + 1 < len(argv) else "")
                found = _folded_module(value)
            else:
                value = value or (argv[i + 1] if "=" not in arg and i + 1 < len(argv) else None)
                key = key.removeprefix("model.").removeprefix("init_args.")
                found = _moved_model_key(key, "--model.init_args.", value)
            if found:
                return found
    return None


def _moved_in_yaml(path: Path) -> str | None:
    try:
        config = yaml.safe_load(path.read_text()) if path.is_file() else None
    except yaml.YAMLError:
        return None  # the CLI's own parser reports malformed YAML
    if not isinstance(config, dict):
        return None
    found = None
    model = config.get("model")
    if isinstance(model, dict):
        found = _folded_module(model.get("class_path"))
        args, prefix = (
            (model["init_args"], "model.init_args.") if isinstance(model.get("init_args"), dict) else (model, "model.")
        )
        found = found or next((m for key, value in args.items() if (m := _moved_model_key(key, prefix, value))), None)
    trainer = config.get("trainer")
    callbacks = trainer.get("callbacks") or trainer.get("callbacks+") if isinstance(trainer, dict) else None
    for callback in callbacks if isinstance(callbacks, list) else []:
        found = found or _moved_callback_key(callback)
    return found


def _folded_module(class_path: Any) -> str | None:
    name = str(class_path or "").removeprefix("xtl.train.").rsplit(".", 1)[-1]
    if not str(class_path or "").startswith("xtl.train") or name not in FOLDED_MODULES:
        return None
    return (
        f"model.class_path {class_path}: one xtl.train.LanguageModule trains every model family; write "
        f"{FOLDED_MODULES[name]}"
    )


def _moved_model_key(key: str, prefix: str, value: Any = None) -> str | None:
    if key not in MOVED_MODEL_KEYS:
        return moved_rl_key(key, value, prefix)
    return (
        f"{prefix}{key} has moved to {prefix}{MOVED_MODEL_KEYS[key]} (optimizer, schedule and family settings are "
        "grouped under optimizer:, schedule: and routing:, see docs/configs.md)"
    )


def _moved_callback_key(callback: Any) -> str | None:
    if not isinstance(callback, dict) or not isinstance(callback.get("init_args"), dict):
        return None
    name = str(callback.get("class_path", "")).rsplit(".", 1)[-1]
    for key in callback["init_args"]:
        if (name, key) in MOVED_CALLBACK_KEYS:
            return f"trainer.callbacks {name}.init_args.{key} has moved: {MOVED_CALLBACK_KEYS[name, key]}"
    return None
