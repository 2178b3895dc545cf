"""``xtl fit|validate|test|predict``: the LightningCLI with xtl's module base, data module and error reporting.

:mod:`xtl.command` is the ``xtl`` command itself; it hands these subcommands to :func:`main`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from xtl.cli_parser import XTLArgumentParser, user_error_message
from xtl.data import XTLDataModule
from xtl.errors import ConfigError, debug_enabled
from xtl.moved_settings import moved_setting_error
from xtl.run_layout import (
    SaveRunConfig,
    checkpoint_folders,
    checkpoint_staging_dir,
    class_path_of,
    refuse_stale_checkpoints,
    root_outputs_at,
)
from xtl.strategies.checkpoint_io import LIGHTNING_METADATA, raise_if_unreadable
from xtl.strategies.remote_checkpoint import fetch, is_url
from xtl.strategies.restart import Resume, resolve_ckpt_path
from xtl.train import LanguageModule
from xtl.train.optim import OptimizerConfig

CKPT_KEYWORDS = ("last", "best", "hpc")  # --ckpt_path values Lightning resolves itself (xtl's: auto, none)
ARCHITECTURE_KEYS = ("model", "model_overrides")  # model.init_args keys a checkpoint always decides

# An optimizer is any OptimizerConfig subclass, chosen in YAML by class_path (AdamWConfig by default).
set_parsing_settings(subclasses_enabled=[OptimizerConfig])


class XTLCLI(LightningCLI):
    """LightningCLI with xtl's module base (``class_path`` picks the family) and data module."""

    _only: str | None = None  # the subcommand that runs (None: every one)
    _resume: Resume = Resume(None)  # what --ckpt_path resolved to (xtl.strategies.restart): Lightning gets its path

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        words = sys.argv[1:] if args is None else args
        every = LightningCLI.subcommands()
        # the parser of the subcommand that runs only: each one is the Trainer's, the model's and the data's whole
        # signature (half a second apiece); another name (a typo, --help) gets them all, to list them
        self._only = words[0] if words and words[0] in every else None
        super().__init__(
            LanguageModule,
            XTLDataModule,
            parser_class=XTLArgumentParser,
            subclass_mode_model=True,
            subclass_mode_data=False,
            save_config_callback=SaveRunConfig,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        """Lightning's subcommands, only the one that runs when the command line names one."""
        every = LightningCLI.subcommands()
        return {self._only: every[self._only]} if self._only else every

    def before_instantiate_classes(self) -> None:
        """Lay the run out in ``trainer.default_root_dir`` (:mod:`xtl.run_layout`), check the accelerator exists,
        count steps in the progress bar, watch the ranks of a fit (:class:`~xtl.callbacks.RankWatchdog`)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        root_outputs_at(config, self.subcommand)
        if self.subcommand == "fit" and self._resume.path is None and not self._resume.automatic:
            refuse_stale_checkpoints(config)
        trainer = config.trainer
        missing = missing_accelerator(trainer.accelerator)
        if missing:
            raise ConfigError(missing)
        fallback = bf16_fallback(trainer.precision, trainer.accelerator)
        if fallback is not None:
            print(f"xtl: {fallback}", file=sys.stderr)
            trainer.precision = "32-true"
        bars = [c for c in trainer.callbacks or [] if "ProgressBar" in class_path_of(c)]
        if trainer.enable_progress_bar is not False and not bars:
            bar = Namespace(class_path="xtl.callbacks.StepProgressBar", init_args=Namespace(refresh_rate=1))
            trainer.callbacks = [*(trainer.callbacks or []), bar]
        if self.subcommand == "fit" and not any("RankWatchdog" in class_path_of(c) for c in trainer.callbacks or []):
            watchdog = Namespace(class_path="xtl.callbacks.RankWatchdog", init_args=Namespace())  # inert on 1 process
            trainer.callbacks = [*(trainer.callbacks or []), watchdog]

    def _parse_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path auto`` / ``none`` / ``last`` and a restarted fit (:mod:`xtl.strategies.restart`;
        rank 0 prints the outcome), check a checkpoint file or directory, refuse one saved by another objective than
        the config's model class (:func:`_refuse_foreign_checkpoint`), then take the model's settings from the
        checkpoint (as Lightning does) but keep the ``--model...`` options typed on the command line: what the user
        types wins over the checkpoint, which wins over the config files."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        self._resume = resolve_ckpt_path(config.get("ckpt_path"), subcommand, checkpoint_folders(config))
        if _rank() == 0:
            for line in self._resume.lines:
                print(line, file=sys.stderr, flush=True)
        path = self._resume.path
        if path in CKPT_KEYWORDS:  # Lightning finds it; a local last checkpoint is checked for its objective here
            found = self._resume.found
            if found is not None and not is_url(found):
                raise_if_unreadable(Path(found))
                _refuse_foreign_checkpoint(found, _hyper_parameters(found), config.get("model"), path)
            return
        if not path:
            return
        if is_url(path):  # a remote checkpoint (a URL, or auto in a URL folder): loaded from a local download
            path = str(fetch(path, checkpoint_staging_dir(config, path)))
            self._resume = dataclasses.replace(self._resume, path=path)
        raise_if_unreadable(Path(path))
        hparams = _hyper_parameters(path)
        _refuse_foreign_checkpoint(path, hparams, config.get("model"), config.get("ckpt_path"))
        hparams.pop("_instantiator", None)
        for key in _typed_model_keys(XTLArgumentParser.argv):
            _drop_key(hparams, key)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        """Lightning's arguments of the subcommand, with ``ckpt_path`` as resolved (the saved config keeps what the
        user wrote: ``auto`` resumes again from the run's newest checkpoint)."""
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if "ckpt_path" in kwargs:
            kwargs["ckpt_path"] = self._resume.path
        return kwargs


class ParseOnlyCLI(XTLCLI):
    """The config a command line would run, parsed by xtl's parser and nothing more: no seed set, no hook, no
    class instantiated (``ParseOnlyCLI(args=[...], run=False).config``; for tools that read a training config)."""

    def parse_arguments(self, parser: XTLArgumentParser, args: Any) -> None:
        """Parse ``args`` (without LightningCLI's warning about ``sys.argv``)."""
        self.config = parser.parse_args(args)

    def before_instantiate_classes(self) -> None:
        """Nothing: the run is not laid out."""

    def instantiate_classes(self) -> None:
        """Nothing: no class is built."""

    def after_instantiate_classes(self) -> None:
        """Nothing."""

    def _set_seed(self) -> None:  # no global side effects
        pass


def main(argv: list[str] | None = None) -> int:
    """Run ``xtl fit|validate|test|predict ...`` (``argv``: the arguments after ``xtl``, default ``sys.argv[1:]``).

    Returns:
        The exit code: 0, or 2 for a user error (printed in one line, ``XTL_DEBUG=1`` raises it instead).
    """
    explicit = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    moved = moved_setting_error(argv)
    if moved:
        print(f"xtl: error: {moved}", file=sys.stderr)
        return 2
    XTLArgumentParser.argv = argv
    try:
        XTLCLI(args=argv if explicit else None)
    except Exception as exc:
        message = user_error_message(exc)
        if message is None or debug_enabled():
            raise
        if _rank() == 0:  # every rank of a distributed run meets the same error; one says it
            print(f"xtl: error: {message}", file=sys.stderr)
        return 2
    return 0


def missing_accelerator(accelerator: Any) -> str | None:
    """Why ``trainer.accelerator`` cannot run here (a GPU recipe on a machine without one), or ``None``."""
    name = str(accelerator or "auto")
    if name in ("gpu", "cuda") and not torch.cuda.is_available():
        return (
            f"trainer.accelerator is {name} but this machine has no usable GPU (torch.cuda.is_available() is false): "
            "run on a GPU machine, or try the recipe on CPU with --trainer.accelerator cpu and a tiny model"
        )
    return None


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


def _hyper_parameters(path: str) -> dict[str, Any]:
    """The ``hyper_parameters`` a checkpoint file or DCP directory (its ``meta.pt``) was saved with."""
    source = Path(path) / LIGHTNING_METADATA if Path(path).is_dir() else Path(path)
    return dict(torch.load(source, weights_only=True, map_location="cpu").get("hyper_parameters", {}))


def _refuse_foreign_checkpoint(path: str, hparams: dict[str, Any], model: Any, given: Any) -> None:
    """Raise when the checkpoint at ``path`` was saved by another LightningModule class (another objective: SFT,
    DPO, GRPO, ...) than the one the config's ``model.class_path`` names: resuming or evaluating it would silently
    run the checkpoint's objective instead. A config that names no model class takes the checkpoint's."""
    saved = hparams.get("_class_path")
    configured = model.get("class_path") if isinstance(model, (Namespace, dict)) else None
    if not saved or not configured or _same_class(saved, configured):
        return
    where = path if given in (None, path) else f"{path} (--ckpt_path {given})"
    raise ConfigError(
        f"checkpoint {where} was saved by a {_family(saved)} run ({saved}), but this config trains "
        f"{_family(configured)} (model.class_path {configured}): --ckpt_path resumes or evaluates a run of the same "
        "objective only. To start from that run's weights, set model.init_args.model to its HF export "
        "(<run>/hf/final, written by a fit with --config callbacks/hf_export.yaml) and leave --ckpt_path out, as "
        "configs/tiny_dpo.yaml starts from the tiny SFT run"
    )


def _same_class(first: str, second: str) -> bool:
    """Whether two class paths name the same class (``xtl.train.LanguageModule`` is ``xtl.train.base.LanguageModule``);
    by name where one cannot be imported."""
    try:
        return _import_class(first) is _import_class(second)
    except (ImportError, AttributeError, ValueError):
        return first == second


def _import_class(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _family(class_path: str) -> str:
    """The objective a LightningModule class trains, as users name it (its ``objective``; else its class name)."""
    try:
        return str(_import_class(class_path).objective)
    except (ImportError, AttributeError, ValueError):
        return class_path.rsplit(".", 1)[-1]


def _typed_model_keys(argv: list[str]) -> list[list[str]]:
    """The model keys set by options of the command line itself (not of its ``--config`` files), as paths under
    ``model.init_args`` (``--model.init_args.generation.max_new_tokens 8`` -> ``["generation", "max_new_tokens"]``),
    but for the model's architecture, which is the checkpoint's."""
    keys = []
    for arg in argv:
        if arg.startswith("--model."):
            path = arg[len("--model.") :].split("=", 1)[0].removeprefix("init_args.").split(".")
            if path[0] not in ARCHITECTURE_KEYS:
                keys.append(path)
    return keys


def _drop_key(tree: dict, path: list[str]) -> None:
    """Remove ``tree[path[0]][path[1]]...`` where it exists."""
    for name in path[:-1]:
        tree = tree.get(name) if isinstance(tree, dict) else None
        if tree is None:
            return
    if isinstance(tree, dict):
        tree.pop(path[-1], None)


def _rank() -> int:
    """This process's global rank as its launcher set it (0 without one)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


if __name__ == "__main__":
    sys.exit(main())
