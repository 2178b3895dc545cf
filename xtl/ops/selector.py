"""The HF-parity switch that every op selector of :mod:`xtl.ops` reads.

With ``XTL_HF_IMPL=1`` each selector returns the op that is bitwise equal to transformers' eager path, whatever
implementation was asked for; code outside :mod:`xtl.ops` calls a selector and never reads the switch itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

HF_IMPL_ENV = "XTL_HF_IMPL"
_TRUE = {"1", "true", "yes", "on"}


def hf_impl_enabled() -> bool:
    """Whether op selectors must return the op that is bitwise equal to transformers' eager path.

    Read live from the ``XTL_HF_IMPL`` environment variable so a test can toggle it per model instance.
    """
    return os.environ.get(HF_IMPL_ENV, "0").strip().lower() in _TRUE


@contextmanager
def hf_impl(enabled: bool = True) -> Iterator[None]:
    """Temporarily set ``XTL_HF_IMPL`` (restores the previous value on exit).

    Args:
        enabled: Turn the HF-parity ops on (``True``) or off (``False``) inside the block.
    """
    previous = os.environ.get(HF_IMPL_ENV)
    os.environ[HF_IMPL_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(HF_IMPL_ENV, None)
        else:
            os.environ[HF_IMPL_ENV] = previous
