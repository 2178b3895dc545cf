"""Fixtures for the tool tests: tiny safetensors checkpoints written in the test's tmp dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tools.ckpt_utils import ShardSpec, write_checkpoint


@pytest.fixture
def make_ckpt(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``make_ckpt(name, shards, config=None, index=True)`` -> checkpoint directory under tmp_path."""

    def make(name: str, shards: ShardSpec, config: dict | None = None, index: bool = True) -> Path:
        return write_checkpoint(tmp_path / name, shards, config, index)

    return make
