"""The one error type for mistakes a user makes and can fix: config, data, paths, checkpoints.

Every seam raises a subclass (``DataError``, ``CheckpointError``, ``ConfigError``, the tools' ``ToolInputError``)
whose message says what is wrong, where (YAML key, or data ``file:line``) and what to do. The ``xtl`` command
prints such an error in a few lines with exit code 2 and no traceback; ``XTL_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable


class UserError(Exception):
    """A mistake in the user's config, data, paths or checkpoints (not a bug of xtl)."""


class ConfigError(UserError, ValueError):
    """A config value or key that xtl cannot use; the message names the key."""


def debug_enabled() -> bool:
    """Whether ``XTL_DEBUG`` asks for full tracebacks instead of short messages."""
    return os.environ.get("XTL_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate to a misspelled ``name``, or an empty string."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def short_message(exc: BaseException) -> str:
    """The user-facing message of ``exc``, without traceback text that a DataLoader worker may have added."""
    text = str(exc)
    if "Original Traceback" in text:  # re-raised from a DataLoader worker: keep the original message
        lines = [line for line in text.strip().splitlines() if line.strip()]
        last = lines[-1]
        text = last.split(": ", 1)[1] if ": " in last and last.split(": ", 1)[0].endswith("Error") else last
    return text
