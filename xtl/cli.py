"""The ``xtl`` command: LightningCLI for ``fit``/``validate``/``test`` plus tool subcommands.

Examples::

    xtl fit --config configs/tiny_sft.yaml
    xtl fit --config configs/tiny_sft.yaml --config callbacks/eval.yaml --config callbacks/hf_export.yaml
    xtl fit --config runs/tiny_sft/logs/version_0/config.yaml --ckpt_path last      # resume exactly
    xtl validate --config configs/tiny_sft.yaml --ckpt_path runs/tiny_sft/checkpoints/last.ckpt
    xtl memory qwen3-8b --gpus-per-node 8 --seq-len 32768
    xtl convert to-fp8 --help
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from xtl.data import XTLDataModule
from xtl.errors import UserError, debug_enabled, did_you_mean, short_message
from xtl.strategies.checkpoint_io import raise_if_unreadable
from xtl.train import LanguageModule
from xtl.train.optim import OptimizerConfig

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
CKPT_KEYWORDS = ("last", "best", "hpc")  # --ckpt_path values Lightning resolves itself

# Model arguments that were grouped into ``optimizer`` / ``schedule``: old key -> new key (under model.init_args).
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
}

# An optimizer is any OptimizerConfig subclass, chosen in YAML by class_path (AdamWConfig by default).
set_parsing_settings(subclasses_enabled=[OptimizerConfig])

# xtl checkpoints the state after each optimizer step on purpose (one training_step is one optimizer step, and
# resuming from it is exact); Lightning's advice to save pre-optimization state does not apply.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
# Third-party notices a user cannot act on: torch's pytree deprecation inside Lightning, Lightning's LitLogger ad.
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


for _name in ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
    logging.getLogger(_name).addFilter(_DropTips())


class XTLArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, reporting a bad config in a few lines (no usage dump) with exit code 2."""

    def error(self, message: str, ex: Exception | None = None) -> None:
        """Print the problem and how to see the options, then exit 2 (``XTL_DEBUG=1``: the parser's own report)."""
        if debug_enabled():
            super().error(message, ex)
        lines = [line.rstrip() for line in str(message).strip().splitlines() if line.strip()]
        unknown = re.search(r"[Oo]ption '([\w.]+)'|[Kk]ey '([\w.]+)' is not expected", lines[0])
        hint = did_you_mean(next(g for g in unknown.groups() if g), _known_keys(self)) if unknown else ""
        print(f"xtl: error: {lines[0]}{hint}", file=sys.stderr)
        for line in lines[1:12]:
            print(f"  {line.strip()}", file=sys.stderr)
        print("  (`xtl fit --help` lists the keys; `--print_config` shows the merged config)", file=sys.stderr)
        sys.exit(2)


class XTLCLI(LightningCLI):
    """LightningCLI with xtl's module base (``class_path`` picks the family) and data module."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LanguageModule,
            XTLDataModule,
            parser_class=XTLArgumentParser,
            subclass_mode_model=True,
            subclass_mode_data=False,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )

    def before_instantiate_classes(self) -> None:
        """Resolve the run's relative output paths against ``trainer.default_root_dir``; count steps in the bar."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        root_outputs_at(config)
        trainer = config.trainer
        fallback = bf16_fallback(trainer.precision, trainer.accelerator)
        if fallback is not None:
            print(f"xtl: {fallback}", file=sys.stderr)
            trainer.precision = "32-true"
        bars = [c for c in trainer.callbacks or [] if "ProgressBar" in str(getattr(c, "class_path", ""))]
        if trainer.enable_progress_bar is not False and not bars:
            bar = Namespace(class_path="xtl.callbacks.StepProgressBar", init_args=Namespace(refresh_rate=1))
            trainer.callbacks = [*(trainer.callbacks or []), bar]

    def _parse_ckpt_path(self) -> None:
        """Check a ``--ckpt_path`` file or directory before Lightning reads its hyperparameters from it."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path and path not in CKPT_KEYWORDS:
            raise_if_unreadable(Path(path))
        super()._parse_ckpt_path()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xtl`` console script."""
    try:
        return _main(argv)
    except BrokenPipeError:  # output piped into a reader that stopped early (``| head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    explicit = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in LIGHTNING_SUBCOMMANDS and not argv[0].startswith("-"):
        from xtl.tools import TOOLS

        if argv[0] in TOOLS:
            return TOOLS[argv[0]](argv[1:])
        names = ", ".join([*LIGHTNING_SUBCOMMANDS, *TOOLS])
        print(f"xtl: unknown command {argv[0]!r}; commands: {names}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        if not argv:
            return 2
    moved = moved_key_error(argv)
    if moved:
        print(f"xtl: error: {moved}", file=sys.stderr)
        return 2
    try:
        XTLCLI(args=argv if explicit else None)
    except Exception as exc:
        cause = _user_error_in(exc)
        if cause is None or debug_enabled():
            raise
        if _rank() == 0:  # every rank of a distributed run meets the same error; one says it
            print(f"xtl: error: {short_message(cause)}", file=sys.stderr)
        return 2
    return 0


def bf16_fallback(precision: Any, accelerator: Any) -> str | None:
    """A note when ``precision`` asks for bf16 that the accelerator cannot compute (the run then uses fp32).

    bf16 runs on CUDA devices that report bf16 support and on CPUs with native bf16 instructions (AVX512-BF16,
    AMX); elsewhere autocast would emulate it, slower than fp32.
    """
    if not str(precision).startswith("bf16"):
        return None
    name = str(accelerator or "auto")
    use_cuda = name in ("cuda", "gpu") or name == "auto" and torch.cuda.is_available()
    if use_cuda:
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        where = "this GPU"
    elif name in ("cpu", "auto"):
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        where = "this CPU (no AVX512-BF16 or AMX)"
    else:
        return None
    if supported:
        return None
    return f"trainer.precision {precision} is not supported natively on {where}; training in 32-true instead"


def root_outputs_at(config: Any) -> None:
    """Make ``trainer.default_root_dir`` the one folder a run writes to.

    Relative ``save_dir`` of the loggers and relative ``dirpath`` of the callbacks (checkpoints, HF exports) are
    taken relative to ``trainer.default_root_dir`` and made absolute, so ``--trainer.default_root_dir DIR`` moves
    everything the run writes (logs, the saved config, checkpoints, exports, reports). Absolute paths stay.
    """
    trainer = config.trainer
    root = Path(trainer.default_root_dir or ".").resolve()
    trainer.default_root_dir = str(root)
    loggers = trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]
    for entry, key in [(e, "save_dir") for e in loggers] + [(c, "dirpath") for c in trainer.callbacks or []]:
        init_args = getattr(entry, "init_args", None)
        value = getattr(init_args, key, None) if init_args is not None else None
        if isinstance(value, str) and not Path(value).is_absolute():
            setattr(init_args, key, str(root / value))


def moved_key_error(argv: list[str]) -> str | None:
    """A message naming the new key when ``argv`` or a ``--config`` file uses a model key that has moved."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv) or arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1] if "=" in arg else argv[i + 1])
            found = _moved_in_yaml(path)
            if found:
                return f"{path}: {found}"
        elif arg.startswith("--model."):
            key = arg[2:].split("=", 1)[0]
            found = _moved(key.removeprefix("model.").removeprefix("init_args."), "--model.init_args.")
            if found:
                return found
    return None


def _rank() -> int:
    """This process's global rank as its launcher set it (0 without one)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _user_error_in(exc: BaseException) -> UserError | None:
    """``exc`` or the user error it was raised from (jsonargparse wraps errors of the classes it instantiates)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _known_keys(parser: Any) -> list[str]:
    """Every option key of ``parser`` and of its subcommand parsers (``trainer.max_steps``, ...)."""
    keys = []
    for action in parser._actions:
        if isinstance(getattr(action, "choices", None), dict):
            for sub in action.choices.values():
                keys += _known_keys(sub)
        elif action.dest:
            keys.append(action.dest)
    return keys


def _moved_in_yaml(path: Path) -> str | None:
    try:
        config = yaml.safe_load(path.read_text()) if path.is_file() else None
    except yaml.YAMLError:
        return None  # the CLI's own parser reports malformed YAML
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return None
    args, prefix = (
        (model["init_args"], "model.init_args.") if isinstance(model.get("init_args"), dict) else (model, "model.")
    )
    for key in args:
        found = _moved(key, prefix)
        if found:
            return found
    return None


def _moved(key: str, prefix: str) -> str | None:
    if key not in MOVED_MODEL_KEYS:
        return None
    return (
        f"{prefix}{key} has moved to {prefix}{MOVED_MODEL_KEYS[key]} (optimizer and learning-rate schedule settings "
        "are grouped under optimizer: and schedule:, see docs/configs.md)"
    )


if __name__ == "__main__":
    sys.exit(main())
