"""Lazy, per-key reading of Hugging Face safetensors checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpointLoader:
    """Reads tensors of a sharded (``model.safetensors.index.json``) or single-file checkpoint by key.

    Shards are opened on first use and only the requested tensors are read.

    Args:
        path: Checkpoint directory.

    Raises:
        FileNotFoundError: When the directory has neither an index nor ``model.safetensors``, or a shard named by
            the index is missing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self.path} does not exist")
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"{index} is not a valid safetensors index ({err}); regenerate it") from err
        elif (self.path / SINGLE_NAME).is_file():
            with safe_open(self.path / SINGLE_NAME, framework="pt") as f:
                weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.path} holds neither {INDEX_NAME} nor {SINGLE_NAME}; is it a Hugging Face model directory?"
            )
        for shard in sorted(set(weight_map.values())):
            if not (self.path / shard).is_file():
                raise FileNotFoundError(f"shard {shard} named in {index} is missing from {self.path}")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, Any] = {}

    def keys(self) -> list[str]:
        """Every tensor key of the checkpoint."""
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of ``key`` without reading its data."""
        return tuple(self._handle(key).get_slice(key).get_shape())

    def load(self, key: str) -> torch.Tensor:
        """Read one tensor.

        Raises:
            KeyError: ``key`` is not in the checkpoint.
        """
        return self._handle(key).get_tensor(key)

    def close(self) -> None:
        """Release the open shard handles."""
        self._handles.clear()

    def _handle(self, key: str) -> Any:
        if key not in self.weight_map:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.path}")
        shard = self.weight_map[key]
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.path / shard, framework="pt")
        return self._handles[shard]
