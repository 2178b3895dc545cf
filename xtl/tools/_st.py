"""Streaming safetensors helpers shared by the checkpoint tools.

Everything here touches at most one tensor (reading) or one output shard (writing) at a time, so the tools work on
checkpoints larger than RAM. Headers are read through ``safetensors.safe_open``, which memory-maps the file and only
materializes a tensor when it is asked for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from xtl.tools._cli import ToolInputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
STANDARD_SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
GIB = 1024**3

DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
    "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8,
}  # fmt: skip


class CheckpointReader:
    """Read-only view of a safetensors checkpoint directory (sharded with an index, or unsharded).

    The index (if any) is checked against the shard headers up front: a shard named by the index that does not
    exist, a tensor listed for a shard that does not hold it, or a tensor present in a shard but absent from the
    index raises ``ToolInputError`` naming the culprit.

    Args:
        directory (str | Path): Checkpoint directory.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ToolInputError(f"checkpoint directory not found: {self.directory}")
        self._headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            self.weight_map = _load_index(index)
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise ToolInputError(f"{self.directory} has neither {INDEX_NAME} nor any *.safetensors file")
            if len(files) > 1:
                raise ToolInputError(f"{self.directory} has {len(files)} safetensors files but no {INDEX_NAME}")
            self.weight_map = {name: files[0] for name in self._header(files[0])}
        self._validate()

    @property
    def shards(self) -> list[str]:
        """list[str]: Shard file names, sorted."""
        return sorted(set(self.weight_map.values()))

    @property
    def names(self) -> list[str]:
        """list[str]: Tensor names grouped by shard (shard order), in each shard's header order."""
        return [name for shard in self.shards for name in self._header(shard)]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """Return the safetensors dtype string (e.g. ``"BF16"``) and shape of ``name`` without loading it.

        Args:
            name (str): Tensor name.

        Returns:
            tuple[str, tuple[int, ...]]: dtype string and shape.
        """
        return self._header(self.weight_map[name])[name]

    def nbytes(self, name: str) -> int:
        """Return the stored size of ``name`` in bytes.

        Args:
            name (str): Tensor name.

        Returns:
            int: Size in bytes.
        """
        dtype, shape = self.info(name)
        return tensor_nbytes(dtype, shape)

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor.

        Args:
            name (str): Tensor name.

        Returns:
            torch.Tensor: The tensor (CPU).
        """
        with safe_open(self.directory / self.weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    def iter_shard(self, shard: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for every tensor of one shard, one at a time.

        Args:
            shard (str): Shard file name.

        Yields:
            tuple[str, torch.Tensor]: Name and tensor.
        """
        with safe_open(self.directory / shard, framework="pt") as f:
            for name in self._header(shard):
                yield name, f.get_tensor(name)

    def total_size(self) -> int:
        """Return the summed size of all tensors in bytes.

        Returns:
            int: Bytes.
        """
        return sum(self.nbytes(n) for n in self.weight_map)

    def _header(self, shard: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        if shard not in self._headers:
            path = self.directory / shard
            if not path.is_file():
                raise ToolInputError(f"shard {shard} listed in {self.directory / INDEX_NAME} does not exist")
            header: dict[str, tuple[str, tuple[int, ...]]] = {}
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    header[name] = (sl.get_dtype(), tuple(sl.get_shape()))
            self._headers[shard] = header
        return self._headers[shard]

    def _validate(self) -> None:
        for shard in self.shards:
            header = self._header(shard)
            listed = {n for n, s in self.weight_map.items() if s == shard}
            missing = sorted(listed - header.keys())
            if missing:
                raise ToolInputError(f"index lists {len(missing)} tensor(s) not found in {shard}, e.g. {missing[0]}")
            unlisted = sorted(header.keys() - listed)
            if unlisted:
                raise ToolInputError(f"{shard} holds {len(unlisted)} tensor(s) missing from the index: {unlisted[0]}")


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Return the size in bytes of a tensor with safetensors dtype string ``dtype`` and ``shape``.

    Args:
        dtype (str): safetensors dtype string such as ``"BF16"``.
        shape (Iterable[int]): Shape.

    Returns:
        int: Bytes.
    """
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * DTYPE_BYTES[dtype]


def parse_size(text: str) -> int:
    """Parse a shard size: a bare number means GiB (fractions allowed); suffixes B, KB, MB, GB, KiB, MiB, GiB.

    Args:
        text (str): e.g. ``"4"``, ``"0.5"``, ``"300KiB"``, ``"2000B"``.

    Returns:
        int: Bytes (at least 1).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    units = {"": GIB, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": GIB}
    if not match or match.group(2).lower() not in units:
        raise ToolInputError(f"invalid size {text!r}: use a number of GiB or a suffix such as 500MB, 64KiB, 2000B")
    size = int(float(match.group(1)) * units[match.group(2).lower()])
    if size < 1:
        raise ToolInputError(f"size {text!r} must be positive")
    return size


def shard_name(index: int, total: int) -> str:
    """Return the HF-standard shard file name (1-based ``index``).

    Args:
        index (int): 1-based shard number.
        total (int): Number of shards.

    Returns:
        str: e.g. ``model-00001-of-00003.safetensors``.
    """
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def is_standard_layout(shards: Iterable[str]) -> bool:
    """Whether shard names are ``model.safetensors`` alone or a complete ``model-i-of-N`` series.

    Args:
        shards (Iterable[str]): Shard file names.

    Returns:
        bool: True for a standard layout.
    """
    shards = sorted(shards)
    if shards == [SINGLE_NAME]:
        return True
    matches = [STANDARD_SHARD_RE.match(s) for s in shards]
    if not shards or not all(matches):
        return False
    total = len(shards)
    return all(int(m.group(2)) == total and int(m.group(1)) == i + 1 for i, m in enumerate(matches) if m)


def plan_shards(groups: list[tuple[list[str], int]], max_bytes: int) -> list[list[str]]:
    """Greedily pack groups of tensor names (kept together) into shards of at most ``max_bytes``, in order.

    A single group larger than ``max_bytes`` gets a shard of its own.

    Args:
        groups (list[tuple[list[str], int]]): ``(names, nbytes)`` per group, in output order.
        max_bytes (int): Shard size limit.

    Returns:
        list[list[str]]: Tensor names per shard.
    """
    plan: list[list[str]] = []
    current: list[str] = []
    used = 0
    for names, size in groups:
        if current and used + size > max_bytes:
            plan.append(current)
            current, used = [], 0
        current.extend(names)
        used += size
    if current:
        plan.append(current)
    return plan


def write_shards(
    out_dir: Path,
    plan: list[list[str]],
    fetch: Callable[[str], torch.Tensor],
    first: int,
    total: int,
    desc: str,
) -> dict[str, str]:
    """Write planned shards ``first..first+len(plan)-1`` of ``total``, materializing one shard at a time.

    Args:
        out_dir (Path): Output directory.
        plan (list[list[str]]): Tensor names per shard.
        fetch (Callable[[str], torch.Tensor]): Loads one tensor by name.
        first (int): 1-based number of the first shard written.
        total (int): Total shard count used in the file names.
        desc (str): Progress-bar label.

    Returns:
        dict[str, str]: Weight map (tensor name -> shard file name).
    """
    weight_map: dict[str, str] = {}
    with progress(total=sum(len(s) for s in plan), desc=desc) as bar:
        for offset, names in enumerate(plan):
            name = shard_name(first + offset, total)
            tensors = {}
            for tensor_name in names:
                tensors[tensor_name] = fetch(tensor_name).contiguous()
                bar.update(1)
            save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, name))
            del tensors
    return weight_map


def write_index(out_dir: Path, weight_map: dict[str, str], total_size: int) -> None:
    """Write ``model.safetensors.index.json`` with ``metadata.total_size`` and a name-sorted weight map.

    Args:
        out_dir (Path): Output directory.
        weight_map (dict[str, str]): Tensor name -> shard file name.
        total_size (int): Sum of tensor sizes in bytes.
    """
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    """Copy every non-tensor file of ``src`` (recursively) to ``dst``: configs, tokenizer, code, README.

    Safetensors shards and the safetensors index are skipped.

    Args:
        src (Path): Source directory.
        dst (Path): Destination directory.

    Returns:
        list[str]: Copied paths relative to ``src``.
    """
    copied = []
    for path in sorted(src.rglob("*")):
        if not path.is_file() or path.name.endswith(".safetensors") or path.name == INDEX_NAME:
            continue
        rel = path.relative_to(src)
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / rel)
        copied.append(str(rel))
    return copied


def link_or_copy(src: Path, dst: Path, hardlink: bool) -> None:
    """Hard-link ``src`` to ``dst`` when asked and possible (same filesystem), otherwise copy the bytes.

    Args:
        src (Path): Existing file.
        dst (Path): New path.
        hardlink (bool): Try ``os.link`` first.
    """
    if hardlink:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # cross-device or unsupported filesystem: fall back to a full copy
    shutil.copy2(src, dst)


def progress(total: int, desc: str) -> tqdm:
    """Return a tqdm progress bar on stderr (silent when stderr is not a terminal unless XTL_PROGRESS=1).

    Args:
        total (int): Number of steps.
        desc (str): Label.

    Returns:
        tqdm: Progress bar usable as a context manager.
    """
    show = sys.stderr.isatty() or os.environ.get("XTL_PROGRESS", "0") == "1"
    return tqdm(total=total, desc=desc, unit="tensor", disable=not show, file=sys.stderr)


def _load_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ToolInputError(f"{path} is not valid JSON: {exc}") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ToolInputError(f"{path} has no weight_map")
    return {str(k): str(v) for k, v in weight_map.items()}
