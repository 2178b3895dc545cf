"""The benchmark tests call a side's setup in the test process (``_peers.child_setup`` is meant for a side's own
child): restore what it changes, so later tests in the same worker see the logging, thread count and arguments
they started with."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator

import datasets
import pytest
import torch
from transformers.utils import logging as hf_logging

# the loggers child_setup quiets, and the thread variables pin_threads sets
_LOGGERS = ("lightning.pytorch", "lightning.fabric", "xtl", "trl")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@pytest.fixture(autouse=True)
def _restore_child_setup() -> Iterator[None]:
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    data_bars = datasets.is_progress_bar_enabled()
    threads, argv = torch.get_num_threads(), list(sys.argv)
    env = {name: os.environ.get(name) for name in _THREAD_VARS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    hf_logging.set_verbosity(verbosity)
    if bars:
        hf_logging.enable_progress_bar()
    if data_bars:
        datasets.enable_progress_bars()
    torch.set_num_threads(threads)
    sys.argv[:] = argv
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
