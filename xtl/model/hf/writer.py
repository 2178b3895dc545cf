"""Writing safetensors checkpoints: size-bounded standard shards, the index, and the non-tensor side files.

Write into a temporary directory that is renamed into place on success (``xtl.utils.atomic_directory``): shards
are first written under temporary names and get their final ``model-i-of-N`` names once ``N`` is known.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from xtl.model.hf.format import DEFAULT_MAX_SHARD_SIZE, INDEX_NAME, TOKENIZER_FILES, parse_size, shard_name


class ShardWriter:
    """Packs tensors greedily, in the order given, into ``model-0000i-of-0000N.safetensors`` shards plus an index.

    At most one shard is held in memory. A shard is closed when the next tensor (or group) would push it over
    ``max_shard_size``; a single larger tensor or group gets a shard of its own.

    Args:
        out_dir: Existing directory to write into (normally a temporary directory renamed by the caller).
        max_shard_size: Upper bound per shard with a unit, e.g. ``"5GB"`` or ``"4GiB"`` (see :func:`parse_size`).

    Raises:
        ShardSizeError: ``max_shard_size`` cannot be read.
    """

    def __init__(self, out_dir: str | Path, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> None:
        self.out_dir = Path(out_dir)
        self.max_bytes = parse_size(max_shard_size)
        self.total_size = 0
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor."""
        self.add_group([(key, tensor)])

    def add_group(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Queue tensors that must land in the same shard (e.g. a weight and its scale)."""
        tensors = {key: tensor.detach().contiguous().cpu() for key, tensor in items}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending.update(tensors)
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def add_file(self, path: str | Path, keys: Iterable[str], nbytes: int, hardlink: bool = False) -> None:
        """Emit an existing safetensors file unchanged as the next shard (closing the shard being filled).

        Args:
            path: The file.
            keys: The tensor names it holds.
            nbytes: Their summed size (for ``metadata.total_size``).
            hardlink: Hard-link instead of copying where the filesystem allows (falls back to a copy).
        """
        self._flush()
        name = self._temp_name()
        _link_or_copy(Path(path), self.out_dir / name, hardlink)
        self._shards.append((name, list(keys)))
        self.total_size += nbytes

    def finish(self) -> dict[str, str]:
        """Write the last shard, give every shard its final name, write the index; return the weight map."""
        self._flush()
        total = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, (tmp_name, keys) in enumerate(self._shards, start=1):
            final = shard_name(i, total)
            (self.out_dir / tmp_name).rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(keys, final))
        write_index(self.out_dir, weight_map, self.total_size)
        return weight_map

    def _temp_name(self) -> str:
        return f".shard-{len(self._shards):05d}.tmp"

    def _flush(self) -> None:
        if not self._pending:
            return
        name = self._temp_name()
        save_shard(self.out_dir / name, self._pending)
        self._shards.append((name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0


def save_shard(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors file marked as PyTorch format (``{"format": "pt"}``, as transformers writes it)."""
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_index(out_dir: str | Path, weight_map: dict[str, str], total_size: int) -> None:
    """Write ``model.safetensors.index.json`` with ``metadata.total_size`` and a name-sorted weight map."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(out_dir) / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: str | Path | None, out_dir: str | Path, names: Iterable[str] = TOKENIZER_FILES) -> list[str]:
    """Copy the named files that exist in ``src`` (default: tokenizer files) into ``out_dir``; return their names."""
    if src is None:
        return []
    copied = []
    for name in names:
        path = Path(src) / name
        if path.is_file():
            shutil.copy2(path, Path(out_dir) / name)
            copied.append(name)
    return copied


def copy_non_tensor_files(src: str | Path, out_dir: str | Path) -> list[str]:
    """Copy every file of ``src`` (recursively) but the safetensors files and index: configs, tokenizer, code.

    Returns:
        The copied paths, relative to ``src``.
    """
    src, out_dir = Path(src), Path(out_dir)
    copied = []
    for path in sorted(src.rglob("*")):
        if not path.is_file() or path.name.endswith(".safetensors") or path.name == INDEX_NAME:
            continue
        rel = path.relative_to(src)
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, out_dir / rel)
        copied.append(str(rel))
    return copied


def _link_or_copy(src: Path, dst: Path, hardlink: bool) -> None:
    if hardlink:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # cross-device or unsupported filesystem: fall back to a full copy
    shutil.copy2(src, dst)
