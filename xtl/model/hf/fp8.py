"""Block-quantized fp8 checkpoints (the DeepSeek-V3 / Qwen3-FP8 layout): the format, quantize on save, dequantize
on load.

A quantized weight ``W`` (2D ``(out, in)``, or a 3D expert stack quantized expert by expert) is stored as
``float8_e4m3fn`` next to ``<W>_scale_inv`` (float32, one value per ``128 x 128`` block, shape
``(ceil(d0/128), ceil(d1/128))``, stacked per expert for 3D), so ``W ~= fp8.float() * scale_inv`` block-wise; the
checkpoint's ``config.json`` says so in ``quantization_config`` (``quant_method: fp8``, ``weight_block_size``).

- Load (:func:`block_fp8_weight_block`, :func:`load_dequantized`): each quantized weight is read with its scales and
  dequantized in float32 (:func:`xtl.ops.fp8.dequantize_blockwise`); the caller casts it to the training dtype.
- Save (:func:`quantize_blockwise`, :func:`block_fp8_config`): xtl writes power-of-two scales (``scale_fmt:
  ue8m0``: every block gets the smallest ``s = 2**k >= amax(block) / 448``, values ``saturate(W / s)``) for the
  tensors :func:`quantizable` selects. ``xtl convert to-fp8`` and ``save_hf(fp8="blockwise")`` share these
  functions, so both write the same bytes for the same weights.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from xtl.model.hf.errors import CheckpointFormatError
from xtl.model.hf.reader import CheckpointReader
from xtl.ops.fp8 import dequantize_blockwise

BLOCK = 128
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
FP8_FORMATS = ("blockwise",)
"""Values of ``save_hf(fp8=...)`` / ``HFExport(fp8=...)`` besides ``None``."""

_PREFIX = r"^(?:model\.(?:language_model\.)?|(?:model\.)?mtp\.)?layers\.\d+\."
QUANT_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(_PREFIX + body)
    for body in (
        r"self_attn\.(?:q|k|v|o|q_a|q_b|kv_b)_proj\.weight$",
        r"self_attn\.kv_a_proj_with_mqa\.weight$",
        r"mlp\.(?:gate|up|down)_proj\.weight$",
        r"mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight$",
        r"mlp\.experts\.(?:gate_up_proj|down_proj)$",
        r"mlp\.shared_experts?\.(?:gate|up|down)_proj\.weight$",
        r"linear_attn\.(?:in_proj_qkv|in_proj_z|out_proj)\.weight$",
    )
)
"""The tensors xtl quantizes: attention, dense-MLP, expert (per-expert or fused 3D), shared-expert and
linear-attention projections under ``model.``, ``model.language_model.`` or ``mtp.`` layers. Norms, routers
(``mlp.gate``), embeddings, heads, biases and vision towers never match."""


def quantizable(name: str, shape: Sequence[int]) -> bool:
    """Whether xtl writes HF tensor ``name`` of ``shape`` in fp8: a 2D/3D tensor matching :data:`QUANT_PATTERNS`."""
    return len(shape) in (2, 3) and any(p.search(name) for p in QUANT_PATTERNS)


def quantize_blockwise(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2D weight, or a 3D expert stack expert by expert, to fp8 with per-block power-of-two scales.

    Args:
        weight: ``(d0, d1)`` or ``(experts, d0, d1)`` floating tensor.
        block: Block edge.

    Returns:
        The fp8 weight (same shape) and float32 ``scale_inv`` of shape ``(ceil(d0/block), ceil(d1/block))`` (with
        a leading expert dim for 3D).

    Raises:
        ValueError: ``weight`` is neither 2D nor 3D.
    """
    if weight.dim() == 3:
        pairs = [_quantize_2d(w, block) for w in weight]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    if weight.dim() != 2:
        raise ValueError(f"expected a 2D or 3D tensor, got shape {tuple(weight.shape)}")
    return _quantize_2d(weight, block)


def block_fp8_config(unquantized_matrices: Iterable[str]) -> dict:
    """The ``quantization_config`` block xtl writes next to block-fp8 weights.

    Args:
        unquantized_matrices: HF names of the 2D+ tensors kept in high precision (listed, without ``.weight``,
            in ``modules_to_not_convert`` so loaders do not expect scales for them).
    """
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "scale_fmt": "ue8m0",
        "modules_to_not_convert": sorted({n.removesuffix(".weight") for n in unquantized_matrices}),
    }


def block_fp8_weight_block(directory: str | Path) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a block-fp8 checkpoint directory, ``None`` for an unquantized one.

    Raises:
        CheckpointFormatError: ``quantization_config`` declares fp8 in a form xtl cannot dequantize (per-tensor
            scales, or a format other than e4m3).
    """
    config_path = Path(directory) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointFormatError(
            f"{config_path}: quantization_config.weight_block_size is {block!r}; xtl loads block-quantized fp8 "
            "only (two positive block edges, e.g. [128, 128])"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointFormatError(f"{config_path}: quantization_config.fmt {quant['fmt']!r} is not e4m3")
    return block[0], block[1]


def load_dequantized(reader: CheckpointReader, key: str, block: tuple[int, int] | None) -> torch.Tensor:
    """Read ``key``; a weight stored in fp8 with ``<key>_scale_inv`` comes back dequantized in float32.

    Args:
        reader: The open checkpoint.
        key: Tensor name.
        block: The checkpoint's :func:`block_fp8_weight_block` (``None``: read as stored).

    Raises:
        CheckpointFormatError: An fp8 tensor without scales, or fp8 tensors in a checkpoint whose config does
            not declare block quantization.
    """
    tensor = reader.load(key)
    scale_key = key + SCALE_SUFFIX
    if block is not None and scale_key in reader:
        return dequantize_blockwise(tensor, reader.load(scale_key), block)
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        where = f"has no {scale_key}" if block is not None else "declares no quantization_config in config.json"
        raise CheckpointFormatError(f"{reader.directory}: {key} is {tensor.dtype} but the checkpoint {where}")
    return tensor


def scale_keys(reader: CheckpointReader, keys: Iterable[str], block: tuple[int, int] | None) -> set[str]:
    """The ``_scale_inv`` companions of ``keys`` that :func:`load_dequantized` reads (none if ``block`` is None)."""
    if block is None:
        return set()
    return {key + SCALE_SUFFIX for key in keys if key + SCALE_SUFFIX in reader}


def checkpoint_quantization_config(directory: str | Path) -> dict | None:
    """The ``quantization_config`` ``save_hf(fp8="blockwise")`` writes for the block-fp8 checkpoint at ``directory``
    (the tensors it would keep in high precision are the 2D+ ones :func:`quantizable` rejects); ``None`` when the
    checkpoint is not block-fp8."""
    if block_fp8_weight_block(directory) is None:
        return None
    reader = CheckpointReader(directory)
    shapes = {name: reader.shape(name) for name in reader.weight_map if not name.endswith(SCALE_SUFFIX)}
    return block_fp8_config(n for n, shape in shapes.items() if len(shape) >= 2 and not quantizable(n, shape))


def _quantize_2d(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    rb, cb = math.ceil(rows / block), math.ceil(cols / block)
    padded = F.pad(weight.float(), (0, cb * block - cols, 0, rb * block - rows))
    blocks = padded.view(rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))), torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rb * block, cb * block)[:rows, :cols].contiguous(), scale.float()
