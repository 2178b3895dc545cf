"""How the ``xtl`` command reads its arguments and reports what it cannot use: one short message, exit code 2.

- :class:`XTLArgumentParser`: LightningCLI's parser without option abbreviations (``--trainer.max_step`` is an
  error, not ``max_steps``), with "did you mean" for unknown keys and command-line typos (with the full key path of
  a nested option: ``--model.init_args.optimizer.lr`` for ``--model.init_args.optimzer.lr``), and one line for a
  ``class_path`` that names no class, with the closest class of the argument's type.
- :func:`user_error_message`: the message of a user error raised while the CLI instantiates or runs (xtl's
  ``UserError``, or a missing optional package), or ``None`` for a bug.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, ClassVar

from lightning.pytorch.cli import LightningArgumentParser

from xtl.errors import UserError, debug_enabled, did_you_mean, short_message

# "No module named 'x'" (ModuleNotFoundError) or Lightning's "Requirement 'x>=1.0' not met"
_MISSING_PACKAGE = re.compile(r"No module named '([\w.]+)'|Requirement '([^']+)' not met")
# Optional packages -> the xtl extra that installs them.
EXTRAS = {
    "wandb": "wandb", "tensorboard": "tensorboard", "tensorboardX": "tensorboard", "torchao": "fp8", "peft": "lora"
}  # fmt: skip
# jsonargparse's report of a class_path that names no class (a misspelled class or module), and of the argument's type
_BAD_CLASS_PATH = re.compile(
    r"Problem with given class_path '([\w.]+)':\s*(?:module '[\w.]+' has no attribute|No module named)"
    r"|Expected a dot import path string: ([\w.]+)"
)
_CLASS_NAME = re.compile(r"(?<![\w.])((?:[A-Za-z_]\w*\.)+[A-Z]\w*)")


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
        bad_class = class_path_message(str(message), self.argv)
        if bad_class:
            print(f"xtl: error: {bad_class}", file=sys.stderr)
            print("  (`xtl fit --help` lists the keys; `--print_config` shows the merged config)", file=sys.stderr)
            sys.exit(2)
        unknown = re.search(r"[Oo]ption '([\w.]+)'|[Kk]ey '([\w.]+)' is not expected", first)
        hint = ""
        if unknown:
            name = next(g for g in unknown.groups() if g)
            hint = did_you_mean(name, _known_keys(self))
            full = _full_key(name, self.argv)
            if full:
                first = first.replace(f"'{name}'", f"'{full}'")
                hint = _option_hint(name, full, _known_keys(self)) or hint or did_you_mean(full, _known_keys(self))
        unrecognized = re.search(r"[Uu]nrecognized arguments: (.*)", first)
        if unrecognized:
            keys = [t[2:].split("=", 1)[0] for t in unrecognized.group(1).split() if t.startswith("--")]
            hint = ""
            for key in keys:  # a nested parser names its own keys: give them their path on the command line
                full = _full_key(key, self.argv) or key
                if full != key:
                    first = first.replace(f"--{key}", f"--{full}")
                hint += _option_hint(key, full, _known_keys(self))
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


def class_path_message(message: str, argv: list[str]) -> str | None:
    """One line for jsonargparse's report of a ``class_path`` that names no class (its union dump), naming the key and
    the closest class of the argument's type, or ``None`` when ``message`` is about something else.

    Args:
        message: The parser's error message.
        argv: The command line, to name a nested key in full.
    """
    found = _BAD_CLASS_PATH.search(message)
    key = re.search(r'Parser key "([\w.*]+)"', message)
    if found is None or key is None:
        return None
    typed = next(g for g in found.groups() if g)
    name = _full_key(key.group(1), argv) or _config_key(typed, argv) or key.group(1)
    subtypes = re.search(r"Subtypes: \[(.*)\]", message)
    bases = [c for c in map(_import, _CLASS_NAME.findall(subtypes.group(1) if subtypes else "")) if inspect.isclass(c)]
    bases = list(dict.fromkeys(b for b in bases if b.__module__.split(".")[0] not in ("builtins", "collections")))
    choices = _classes(typed, bases)
    close = difflib.get_close_matches(typed.rsplit(".", 1)[-1], list(choices), n=1, cutoff=0.6)
    hint = f" (did you mean {choices[close[0]]!r}?)" if close else ""
    kind = f"; a class_path names a subclass of {', '.join(b.__name__ for b in bases)}" if bases else ""
    return f"{name}: no class {typed!r}{hint}{kind}"


def _config_key(class_path: str, argv: list[str]) -> str | None:
    """The key of the config files of ``argv`` (``--config F``) whose ``class_path`` is ``class_path``, if one."""
    import yaml

    def find(node: Any, path: str) -> str | None:
        if isinstance(node, dict):
            if node.get("class_path") == class_path:
                return path
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in node.items()]
        elif isinstance(node, list):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(node)]
        else:
            return None
        return next((found for key, value in items if (found := find(value, key))), None)

    files = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    files += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    for file in reversed(files):  # the last file that sets it is the one that counts
        try:
            found = find(yaml.safe_load(Path(file).read_text()), "")
        except (OSError, yaml.YAMLError):
            continue
        if found:
            return found
    return None


def _option_hint(name: str, full: str, known: list[str]) -> str:
    """`` (did you mean '--path.to.key'?)`` for the option ``full`` typed on the command line, whose parser knows it
    as ``name`` with the keys ``known``: each level of ``name`` matched to the closest key of that level, the levels
    below the keys known here (a subclass's arguments) kept, and the path before ``name`` kept."""
    levels = name.split(".")
    fixed: list[str] = []
    for depth, level in enumerate(levels):
        below = {k.split(".")[depth] for k in known if k.split(".")[:depth] == fixed and k.count(".") >= depth}
        below.discard("help")  # ``optimizer.help``: the help of a subclass-typed argument, not one of its keys
        if not below:
            fixed += levels[depth:]
            break
        close = [level] if level in below else difflib.get_close_matches(level, list(below), n=1, cutoff=0.75)
        if not close:
            return ""
        fixed.append(close[0])
    if fixed == levels:
        return ""
    return f" (did you mean '--{full[: len(full) - len(name)]}{'.'.join(fixed)}'?)"


def _import(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None


def _classes(typed: str, bases: list[type]) -> dict[str, str]:
    """Class name -> import path of the classes ``typed`` may have meant: the subclasses of ``bases`` (those loaded
    and those the typed module exports) or, without bases, the classes of the typed module."""
    module = None
    parts = typed.split(".")[:-1]
    while parts and module is None:  # the deepest module of the typed path that imports
        try:
            module = importlib.import_module(".".join(parts))
        except ImportError:
            parts.pop()
    found: dict[str, str] = {}
    for name in getattr(module, "__all__", None) or dir(module) if module else []:
        value = _import(f"{module.__name__}.{name}") if not name.startswith("_") else None
        if inspect.isclass(value) and (not bases or issubclass(value, tuple(bases))):
            found.setdefault(value.__name__, f"{module.__name__}.{name}")
    stack = list(bases)
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        if not cls.__name__.startswith("_"):
            found.setdefault(cls.__name__, _public_path(cls))
    return found


def _public_path(cls: type) -> str:
    """The shortest import path of ``cls`` through the packages of its module (``xtl.rl.MathJudger``)."""
    parts = cls.__module__.split(".")
    for depth in range(1, len(parts)):
        package = sys.modules.get(".".join(parts[:depth]))
        if package is not None and cls.__name__ in (getattr(package, "__all__", None) or ()):
            return f"{package.__name__}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


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
