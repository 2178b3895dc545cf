"""What a distributed (DCP) checkpoint directory holds: DCP's ``.metadata``, Lightning's ``meta.pt``, and the shard
files whose byte ranges the metadata names."""

from __future__ import annotations

import pickle
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from xtl.model.hf.errors import CheckpointError

DCP_METADATA = ".metadata"
LIGHTNING_METADATA = "meta.pt"


def dcp_byte_ranges(metadata_file: Path) -> dict[str, int]:
    """Each shard file a DCP ``.metadata`` names (relative to its directory) -> the end of the last byte range it
    names in that file, i.e. the size the file must at least have.

    Raises:
        CheckpointError: The metadata cannot be read or is not DCP metadata (the message says so, to follow "its").
    """
    try:
        with metadata_file.open("rb") as f:
            metadata = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as err:
        raise CheckpointError(f"its {DCP_METADATA} cannot be read ({err})") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"its {DCP_METADATA} is not DCP metadata")
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends
