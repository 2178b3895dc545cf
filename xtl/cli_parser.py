"""How the ``xtl`` command reads its arguments and reports what it cannot use: one short message, exit code 2.

- :class:`XTLArgumentParser`: LightningCLI's parser without option abbreviations (``--trainer.max_step`` is an
  error, not ``max_steps``), with "did you mean" for unknown keys and command-line typos, and the full key path of
  an unknown nested option.
- :func:`user_error_message`: the message of a user error raised while the CLI instantiates or runs (xtl's
  ``UserError``, or a missing optional package), or ``None`` for a bug.
"""

from __future__ import annotations

import re
import sys
from typing import Any, ClassVar

from lightning.pytorch.cli import LightningArgumentParser

from xtl.errors import UserError, debug_enabled, did_you_mean, short_message

# "No module named 'x'" (ModuleNotFoundError) or Lightning's "Requirement 'x>=1.0' not met"
_MISSING_PACKAGE = re.compile(r"No module named '([\w.]+)'|Requirement '([^']+)' not met")
# Optional packages -> the xtl extra that installs them.
EXTRAS = {
    "wandb": "wandb", "tensorboard": "tensorboard", "tensorboardX": "tensorboard", "torchao": "fp8", "peft": "lora"
}  # fmt: skip


class XTLArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, reporting a bad config in a few lines (no usage dump) with exit code 2.

    Attributes:
        argv: The command line being parsed (set by the ``xtl`` entry point), to name a nested key in full.
    """

    argv: ClassVar[list[str]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a prefix of a key is a typo, not that key
        super().__init__(*args, **kwargs)

    def dump(self, namespace: Any, *args: Any, **kwargs: Any) -> str:
        """Serialize a config without validating it again, unless ``skip_validation=False`` is passed: what xtl
        dumps (the saved run config, the model's hyperparameters) was validated when it was parsed, and a second
        validation of the whole config is a noticeable part of a short run's start-up."""
        if "skip_check" not in kwargs:
            kwargs.setdefault("skip_validation", True)
        return super().dump(namespace, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> None:
        """Print the problem and how to see the options, then exit 2 (``XTL_DEBUG=1``: the parser's own report)."""
        if debug_enabled():
            super().error(message, ex)
        lines = [line.rstrip() for line in str(message).strip().splitlines() if line.strip()]
        first = lines[0]
        unknown = re.search(r"[Oo]ption '([\w.]+)'|[Kk]ey '([\w.]+)' is not expected", first)
        hint = ""
        if unknown:
            name = next(g for g in unknown.groups() if g)
            hint = did_you_mean(name, _known_keys(self))
            full = _full_key(name, self.argv)
            if full:
                first = first.replace(f"'{name}'", f"'{full}'")
                hint = hint or did_you_mean(full, _known_keys(self))
        unrecognized = re.search(r"[Uu]nrecognized arguments: (.*)", first)
        if unrecognized:
            keys = [t[2:].split("=", 1)[0] for t in unrecognized.group(1).split() if t.startswith("--")]
            hint = "".join(did_you_mean(key, _known_keys(self)).replace(" '", " '--") for key in keys)
        print(f"xtl: error: {first}{hint}", file=sys.stderr)
        for line in lines[1:12]:
            print(f"  {line.strip()}", file=sys.stderr)
        print("  (`xtl fit --help` lists the keys; `--print_config` shows the merged config)", file=sys.stderr)
        sys.exit(2)


def user_error_message(exc: BaseException) -> str | None:
    """The short message of the user error ``exc`` was raised from, or ``None`` when it is a bug.

    A user error is xtl's ``UserError`` (jsonargparse wraps errors of the classes it instantiates) or a missing
    optional package (a logger or callback whose package is not installed).
    """
    texts = []
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return short_message(exc)
        texts.append(str(exc))
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    # jsonargparse reports a class it could not instantiate in its message text, not as the exception's cause
    found = next((m for t in texts if (m := _MISSING_PACKAGE.search(t))), None)
    if found is None:
        return None
    name = next(g for g in found.groups() if g)
    package = re.split(r"[<>=!~ \[]", name, maxsplit=1)[0].split(".")[0]
    if package == "xtl":  # a module of xtl itself: a bug, not an install
        return None
    extra = EXTRAS.get(package)
    how = f"pip install -e '.[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
    return f"a package this run needs is not installed: {package} ({found.group(0)}); {how}"


def _full_key(name: str, argv: list[str]) -> str | None:
    """The command-line key ending in ``.name`` (``--model.init_args.optimizer.lrr`` for ``lrr``), if one."""
    for arg in argv:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if key == name or key.endswith(f".{name}"):
            return key
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
