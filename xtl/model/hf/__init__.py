"""Hugging Face checkpoint I/O."""

from xtl.model.hf.loader import INDEX_NAME, HFCheckpointLoader
from xtl.model.hf.saver import ShardWriter, copy_side_files, parse_size

__all__ = ["INDEX_NAME", "HFCheckpointLoader", "ShardWriter", "copy_side_files", "parse_size"]
