"""The contract every data layer speaks: ``DataItem`` and the ignore index."""

from __future__ import annotations

from typing import TypedDict

from xtl.errors import UserError

IGNORE_INDEX = -100


class DataItem(TypedDict):
    """One tokenized sample.

    ``labels`` has the length of ``input_ids`` and holds the token id where the token is a training target,
    ``IGNORE_INDEX`` (-100) elsewhere; ``labels[0]`` is always -100 (nothing precedes the first token).
    Labels are *unshifted*: collate shifts them per document.
    """

    input_ids: list[int]
    labels: list[int]
    num_tokens: int


class DataError(UserError, ValueError):
    """Bad input data or data configuration; the message says where (``file:line``) and what to do."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A configured data file or directory does not exist."""
