"""Writing Hugging Face safetensors checkpoints: standard shard names, an index, and side files."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from xtl.model.hf.loader import INDEX_NAME

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Parse ``5GB``, ``500MiB``, ``1.5GiB`` or a byte count into bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", size)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {size!r}; use e.g. '5GB', '500MiB' or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


class ShardWriter:
    """Accumulates tensors and writes ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_size``.

    Shards are first written under temporary names, then renamed once the shard count is known.

    Args:
        out_dir: Directory to write into (normally a temporary directory renamed by the caller).
        max_shard_size: Upper bound per shard (a single larger tensor gets a shard of its own).
    """

    def __init__(self, out_dir: str | Path, max_shard_size: int | str = "5GB") -> None:
        self.out_dir = Path(out_dir)
        self.max_bytes = parse_size(max_shard_size)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_size = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes a shard when the size bound would be exceeded."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[key] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Queue several tensors."""
        for key, tensor in items:
            self.add(key, tensor)

    def finish(self) -> dict[str, str]:
        """Write the remaining shard, rename all shards to their final names, write the index; return weight_map."""
        self._flush()
        total = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, (tmp_name, keys) in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            (self.out_dir / tmp_name).rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f".shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(self.out_dir / name), metadata={"format": "pt"})
        self._shards.append((name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0


def copy_side_files(src: str | Path | None, out_dir: str | Path, names: Iterable[str] = TOKENIZER_FILES) -> list[str]:
    """Copy the named files that exist in ``src`` into ``out_dir``; return the names copied."""
    if src is None:
        return []
    copied = []
    for name in names:
        path = Path(src) / name
        if path.is_file():
            shutil.copy2(path, Path(out_dir) / name)
            copied.append(name)
    return copied
