"""The Hugging Face safetensors layout: file names, the default shard size, size parsing and dtype widths."""

from __future__ import annotations

import re
from collections.abc import Iterable

from xtl.model.hf.errors import ShardSizeError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default for save_pretrained
STANDARD_SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
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

DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
    "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8,
}  # fmt: skip


def parse_size(size: str) -> int:
    """Parse a shard size with an explicit unit into bytes.

    Decimal (``B``, ``KB``, ``MB``, ``GB``, ``TB``) and binary (``KiB``, ``MiB``, ``GiB``, ``TiB``) units are
    accepted, case-insensitively, with fractions: ``5GB``, ``500MB``, ``4GiB``, ``1.5GiB``, ``2000B``.

    Args:
        size: The size text.

    Returns:
        The size in bytes (at least 1).

    Raises:
        ShardSizeError: ``size`` is a bare number (string or int: bytes or GiB would be a guess), has an unknown
            unit, or is not positive.
    """
    if isinstance(size, bool) or not isinstance(size, (str, int, float)):
        raise ShardSizeError(f"max shard size must be a string such as '5GB', got {type(size).__name__}")
    match = _SIZE_RE.fullmatch(str(size))
    if match and not match.group(2):
        raise ShardSizeError(f"max shard size {size!r} has no unit; write e.g. 5GB or 4GiB")
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ShardSizeError(f"cannot read max shard size {size!r}; write e.g. 5GB, 500MB, 4GiB or 300KiB")
    nbytes = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if nbytes < 1:
        raise ShardSizeError(f"max shard size {size!r} must be at least one byte")
    return nbytes


def shard_name(index: int, total: int) -> str:
    """The standard shard file name, e.g. ``model-00001-of-00003.safetensors``.

    Args:
        index: 1-based shard number.
        total: Number of shards.
    """
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def is_standard_layout(shards: Iterable[str]) -> bool:
    """Whether shard names are ``model.safetensors`` alone or a complete ``model-i-of-N`` series.

    Args:
        shards: Shard file names.
    """
    shards = sorted(shards)
    if shards == [SINGLE_NAME]:
        return True
    matches = [STANDARD_SHARD_RE.match(s) for s in shards]
    if not shards or not all(matches):
        return False
    total = len(shards)
    return all(int(m.group(2)) == total and int(m.group(1)) == i + 1 for i, m in enumerate(matches) if m)


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Size in bytes of a tensor with safetensors dtype string ``dtype`` (e.g. ``"BF16"``) and ``shape``."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * DTYPE_BYTES[dtype]


_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")
