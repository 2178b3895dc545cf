"""Errors of the checkpoint I/O package.

Every error the package raises for a bad input is a :class:`CheckpointError` (a ``ValueError``) or a
``FileNotFoundError``, so a command-line front end can map both to its usage/input exit code.
"""

from __future__ import annotations

from xtl.errors import UserError


class CheckpointError(UserError, ValueError):
    """Base class of the package's input errors."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint directory is malformed: unreadable index, index and shard headers disagree, ambiguous files."""


class ShardSizeError(CheckpointError):
    """A shard size cannot be read (no unit, unknown unit, not positive)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not match the model: missing or unexpected keys, or wrong shapes."""
