"""Lazy, validated reading of safetensors checkpoint directories, one tensor at a time.

Headers are read through ``safetensors.safe_open``, which memory-maps a file and materializes a tensor only when it
is asked for, so checkpoints larger than RAM can be read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from xtl.model.hf.errors import CheckpointFormatError
from xtl.model.hf.format import INDEX_NAME, SINGLE_NAME, tensor_nbytes


class CheckpointReader:
    """Read-only view of a checkpoint directory: sharded with ``model.safetensors.index.json``, or one file.

    Construction reads every shard header (names, dtypes, shapes; no tensor data) and checks the index against
    them, so a broken directory fails up front with the culprit named. Tensors are read on request; a shard is
    opened on its first read and kept open until :meth:`close` (or the end of a ``with`` block).

    Args:
        directory: Checkpoint directory. Without an index it must hold exactly one ``*.safetensors`` file (any
            name).

    Raises:
        FileNotFoundError: The directory, or a shard named by the index, does not exist, or the directory holds
            no safetensors file.
        CheckpointFormatError: The index is not valid JSON or has no ``weight_map``; it lists a tensor that its
            shard lacks, or a shard holds a tensor the index omits; a shard is not a safetensors file; several
            files but no index.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
        self._headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._handles: dict[str, Any] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            self.weight_map: dict[str, str] = _read_index(index)
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.directory} holds neither {INDEX_NAME} nor {SINGLE_NAME} (nor any *.safetensors file); "
                    "is it a Hugging Face model directory?"
                )
            if len(files) > 1:
                raise CheckpointFormatError(
                    f"{self.directory} has {len(files)} safetensors files but no {INDEX_NAME}; write an index"
                )
            self.weight_map = dict.fromkeys(self._header(files[0]), files[0])
        self._validate()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __contains__(self, key: object) -> bool:
        return key in self.weight_map

    @property
    def shards(self) -> list[str]:
        """Shard file names, sorted."""
        return sorted(set(self.weight_map.values()))

    def keys(self) -> list[str]:
        """Every tensor name, grouped by shard (shard order) and in each shard's header order."""
        return [name for shard in self.shards for name in self._header(shard)]

    def info(self, key: str) -> tuple[str, tuple[int, ...]]:
        """The safetensors dtype string (e.g. ``"BF16"``) and shape of ``key``, without reading its data.

        Raises:
            KeyError: ``key`` is not in the checkpoint.
        """
        return self._header(self._shard_of(key))[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of ``key`` without reading its data."""
        return self.info(key)[1]

    def nbytes(self, key: str) -> int:
        """Stored size of ``key`` in bytes."""
        return tensor_nbytes(*self.info(key))

    def total_size(self) -> int:
        """Summed size of all tensors in bytes."""
        return sum(self.nbytes(key) for key in self.weight_map)

    def load(self, key: str) -> torch.Tensor:
        """Read one tensor (on CPU).

        Raises:
            KeyError: ``key`` is not in the checkpoint.
        """
        shard = self._shard_of(key)
        if shard not in self._handles:
            self._handles[shard] = self._open(shard)
        return self._handles[shard].get_tensor(key)

    def iter_shard(self, shard: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for every tensor of one shard, in header order, one at a time."""
        with self._open(shard) as f:
            for name in self._header(shard):
                yield name, f.get_tensor(name)

    def close(self) -> None:
        """Release the shard handles opened by :meth:`load`."""
        self._handles.clear()

    def _shard_of(self, key: str) -> str:
        if key not in self.weight_map:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.directory}")
        return self.weight_map[key]

    def _open(self, shard: str) -> Any:
        path = self.directory / shard
        if not path.is_file():
            raise FileNotFoundError(f"shard {shard} listed in {self.directory / INDEX_NAME} does not exist")
        try:
            return safe_open(path, framework="pt")
        except SafetensorError as err:
            raise CheckpointFormatError(f"{path} is not a readable safetensors file ({err})") from err

    def _header(self, shard: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        if shard not in self._headers:
            header: dict[str, tuple[str, tuple[int, ...]]] = {}
            with self._open(shard) as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    header[name] = (view.get_dtype(), tuple(view.get_shape()))
            self._headers[shard] = header
        return self._headers[shard]

    def _validate(self) -> None:
        for shard in self.shards:
            header = self._header(shard)
            listed = {name for name, s in self.weight_map.items() if s == shard}
            missing = sorted(listed - header.keys())
            if missing:
                raise CheckpointFormatError(
                    f"{INDEX_NAME} in {self.directory} lists {len(missing)} tensor(s) not found in {shard}, "
                    f"e.g. {missing[0]}"
                )
            unlisted = sorted(header.keys() - listed)
            if unlisted:
                raise CheckpointFormatError(
                    f"{shard} holds {len(unlisted)} tensor(s) missing from {INDEX_NAME}, e.g. {unlisted[0]}"
                )


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path} is not valid JSON ({err}); regenerate it") from err
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{path} has no weight_map; regenerate it")
    return {str(k): str(v) for k, v in weight_map.items()}
