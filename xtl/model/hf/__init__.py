"""Hugging Face checkpoint I/O: the one package that reads and writes safetensors checkpoint directories.

- :mod:`~xtl.model.hf.format`: file names, the default shard size, :func:`parse_size`, shard naming.
- :mod:`~xtl.model.hf.reader`: :class:`CheckpointReader`, lazy validated per-key reads.
- :mod:`~xtl.model.hf.writer`: :class:`ShardWriter` (size-bounded standard shards + index), side files.
- :mod:`~xtl.model.hf.model_io`: :func:`load_hf_weights` / :func:`save_hf_weights`, the loops behind
  ``BaseModel.from_hf`` / ``BaseModel.save_hf``.
- :mod:`~xtl.model.hf.fp8`: block-quantized fp8 checkpoints (``weight`` + ``weight_scale_inv``): dequantize on
  load, quantize on save, the ``quantization_config`` block.
- :mod:`~xtl.model.hf.errors`: the package's exception classes.
"""

from xtl.model.hf.errors import CheckpointError, CheckpointFormatError, CheckpointMismatchError, ShardSizeError
from xtl.model.hf.format import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    SINGLE_NAME,
    TOKENIZER_FILES,
    is_standard_layout,
    parse_size,
    shard_name,
    tensor_nbytes,
)
from xtl.model.hf.fp8 import (
    FP8_FORMATS,
    QUANT_PATTERNS,
    SCALE_SUFFIX,
    block_fp8_config,
    checkpoint_quantization_config,
    dequantize_blockwise,
    quantizable,
    quantize_blockwise,
)
from xtl.model.hf.model_io import copy_into, load_hf_weights, save_hf_weights
from xtl.model.hf.reader import CheckpointReader
from xtl.model.hf.writer import ShardWriter, copy_non_tensor_files, copy_side_files, save_shard, write_index

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "FP8_FORMATS",
    "INDEX_NAME",
    "QUANT_PATTERNS",
    "SCALE_SUFFIX",
    "SINGLE_NAME",
    "TOKENIZER_FILES",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointReader",
    "ShardSizeError",
    "ShardWriter",
    "block_fp8_config",
    "checkpoint_quantization_config",
    "copy_into",
    "copy_non_tensor_files",
    "copy_side_files",
    "dequantize_blockwise",
    "is_standard_layout",
    "load_hf_weights",
    "parse_size",
    "quantizable",
    "quantize_blockwise",
    "save_hf_weights",
    "save_shard",
    "shard_name",
    "tensor_nbytes",
    "write_index",
]
