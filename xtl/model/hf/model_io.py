"""Loading a model's weights from, and saving them to, a Hugging Face model directory.

The model supplies the key map and the layout hooks through its public methods (:class:`CheckpointModel`, which
``xtl.model.BaseModel`` implements); this module runs the loops: which keys to read, shape checks and strict
errors, DTensor-aware copies, shard writing, side files and fp32-kept tensors. It does not import the model base.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import GenerationConfig

from xtl.model.hf.errors import CheckpointMismatchError
from xtl.model.hf.format import DEFAULT_MAX_SHARD_SIZE, parse_size
from xtl.model.hf.fp8 import (
    FP8_FORMATS,
    SCALE_SUFFIX,
    block_fp8_config,
    block_fp8_weight_block,
    load_dequantized,
    quantizable,
    quantize_blockwise,
    scale_keys,
)
from xtl.model.hf.reader import CheckpointReader
from xtl.model.hf.writer import ShardWriter, copy_side_files
from xtl.module.nf4 import dequantize, is_nf4
from xtl.utils import atomic_directory


class CheckpointModel(Protocol):
    """What loading and saving need from a model (``xtl.model.BaseModel`` has all of it).

    Attributes:
        config: The model config (its ``dtype`` and ``hf_config``).
        hf_dtypes: HF key -> the dtype its checkpoint stored it in (filled by :func:`load_hf_weights`).
    """

    config: Any
    hf_dtypes: dict[str, torch.dtype]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers that map to HF keys."""

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """xtl-only parameters (no HF key), initialized after every load."""

    def hf_keys(self, key: str) -> list[str]:
        """The HF keys of the tensor ``key``."""

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensor ``key`` from its HF tensors."""

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The HF tensors of the tensor ``key``."""

    def ignorable_hf_key(self, key: str) -> bool:
        """Whether an HF key no tensor reads may stay unread."""

    def initializable_hf_key(self, key: str) -> bool:
        """Whether an HF key a tensor reads may be absent (the tensor is then initialized, even when strict)."""

    def keep_fp32_names(self) -> set[str]:
        """Tensors written in fp32 whatever the dtype."""

    def init_tensors(self, names: list[str]) -> None:
        """Initialize the named tensors."""

    def materialize(self, device: torch.device | str) -> None:
        """Allocate a ``meta`` model's storage on ``device``."""


def load_hf_weights(
    model: CheckpointModel, path: str | Path, strict: bool = True, device: torch.device | str | None = None
) -> list[str]:
    """The loop behind ``BaseModel.from_hf``: read, reshape and copy every checkpoint tensor of ``model``.

    For each tensor of ``model.checkpoint_tensors()`` the HF keys come from ``model.hf_keys``, are read lazily and
    combined by ``model.hf_to_param``; a DTensor receives only its local shard. A ``meta`` model is materialized
    on ``device`` (default CPU) first; with ``strict=False`` the tensors whose keys are absent are initialized, and
    so are those whose absent keys ``model.initializable_hf_key`` allows (a new sequence-classification head).
    Checkpoint keys the model does not consume count as unexpected unless ``model.ignorable_hf_key`` says so.
    A block-fp8 checkpoint (``quantization_config`` with ``weight_block_size``; see :mod:`xtl.model.hf.fp8`) is
    dequantized: each fp8 weight is read with its ``_scale_inv`` and cast to the parameter's dtype. The stored dtype
    of every key read unquantized is remembered (``model.hf_dtypes``): :func:`save_hf_weights` writes the key in it.

    Args:
        model: The model (its key map and layout hooks decide what is read).
        path: HF model directory.
        strict: Whether missing or unexpected keys raise; a shape difference always does.
        device: Device a ``meta`` model is materialized on.

    Returns:
        The HF keys ``model`` needed that ``path`` lacks, but those it may lack (always empty when ``strict``).

    Raises:
        CheckpointMismatchError: Lists every missing/unexpected key and every shape difference.
        FileNotFoundError, CheckpointFormatError: ``path`` is not a readable checkpoint directory.
    """
    with CheckpointReader(path) as reader:
        block = block_fp8_weight_block(path)
        tensors = model.checkpoint_tensors()
        if any(t.is_meta for t in tensors.values()):
            model.materialize(device or "cpu")
            tensors = model.checkpoint_tensors()
        missing: list[str] = []
        mismatched: list[str] = []
        consumed: set[str] = set()
        missing_params: list[str] = []
        dtypes: dict[str, torch.dtype] = {}
        for name, param in tensors.items():
            keys = model.hf_keys(name)
            absent = [k for k in keys if k not in reader]
            if absent:
                missing.extend(k for k in absent if not model.initializable_hf_key(k))
                missing_params.append(name)
                continue
            consumed.update(keys)
            scales = scale_keys(reader, keys, block)
            consumed.update(scales)
            stored = [load_dequantized(reader, k, block) for k in keys]
            dtypes.update({k: t.dtype for k, t in zip(keys, stored) if k + SCALE_SUFFIX not in scales})
            full = model.hf_to_param(name, stored)
            if tuple(full.shape) != tuple(param.shape):
                mismatched.append(
                    f"{name} (from {', '.join(keys)}): checkpoint {tuple(full.shape)}, model {tuple(param.shape)}"
                )
                continue
            copy_into(param, full)
        unexpected = sorted(k for k in set(reader.keys()) - consumed if not model.ignorable_hf_key(k))
    if mismatched or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(_mismatch_message(path, missing, unexpected, mismatched))
    model.hf_dtypes = dtypes
    adapters = list(model.adapter_tensors())  # xtl-only weights (LoRA factors): initialized, not loaded
    if missing_params or adapters:
        model.init_tensors(missing_params + adapters)
    return missing


def save_hf_weights(
    model: CheckpointModel,
    out_dir: str | Path,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    source_dir: str | Path | None = None,
    fp8: str | None = None,
    tensor_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    token_ids: dict[str, Any] | None = None,
) -> None:
    """Write an HF model directory: shards, index, ``config.json``, generation config and tokenizer files.

    Under torch.distributed every rank must call this (sharded tensors are gathered one at a time); rank 0
    writes. The directory appears atomically (temp dir, then rename).

    Args:
        model: The model.
        out_dir: Target directory (replaced if it exists).
        max_shard_size: Upper bound per shard with a unit, e.g. ``"5GB"``.
        dtype: Cast floating-point tensors to this dtype. By default each key loaded from an HF checkpoint
            (:func:`load_hf_weights`, unquantized) is written in the dtype it was stored in there, so a load + save
            round trip keeps every tensor's dtype; any other tensor is written in the config's ``dtype`` if set,
            else in its parameter's dtype. Tensors the model declares fp32 (``keep_fp32_names``) are written
            in fp32 unless their checkpoint stored them otherwise (``dtype`` given: always fp32). NF4 (QLoRA) base
            weights are written dequantized.
        source_dir: The HF directory the model was loaded from; its generation config and tokenizer files are
            copied.
        fp8: ``"blockwise"`` writes the tensors :func:`~xtl.model.hf.fp8.quantizable` selects as 128x128
            block-quantized fp8 with ``_scale_inv`` scales (after the ``dtype`` cast) and a ``quantization_config``;
            ``None`` writes every tensor in ``dtype``.
        tensor_transform: ``(name, full) -> full`` applied to each full (gathered) checkpoint tensor before the
            dtype cast, on every rank (it may run collectives), e.g. merging LoRA adapters
            (:func:`~xtl.model.hf.peft_adapter.merge_lora_transform`).
        token_ids: ``bos_token_id`` / ``eos_token_id`` (an id or a list) / ``pad_token_id`` of the tokenizer the
            model was trained with, written to ``config.json`` where the model config leaves them unset and to a
            new ``generation_config.json`` (the source directory's one, when there is one, is copied instead), so
            transformers' ``generate`` stops where xtl's does.

    Raises:
        ShardSizeError: ``max_shard_size`` cannot be read (raised on every rank, before any collective).
        ValueError: ``fp8`` is not ``None`` or ``"blockwise"``.
    """
    parse_size(max_shard_size)  # fail on every rank, before any collective
    if fp8 is not None and fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8 must be null or one of {FP8_FORMATS}; got {fp8!r}")
    stored = model.hf_dtypes if dtype is None else {}  # an explicit dtype overrides the source checkpoint's
    if dtype is None and model.config.dtype is not None:
        dtype = getattr(torch, model.config.dtype)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    with atomic_directory(out_dir) if is_writer else nullcontext(None) as tmp:
        writer = ShardWriter(tmp, max_shard_size) if is_writer else None
        keep_fp32 = model.keep_fp32_names()
        unquantized: list[str] = []
        for name, tensor in model.checkpoint_tensors().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
            if is_nf4(full):  # a QLoRA base weight: its NF4 values, dequantized
                full = dequantize(full)
            if tensor_transform is not None:
                full = tensor_transform(name, full)
            if not is_writer:
                continue
            for key, part in zip(model.hf_keys(name), model.param_to_hf(name, full)):
                part = part.to(_saved_dtype(part, stored.get(key), name in keep_fp32, dtype))
                if fp8 is not None and part.is_floating_point() and quantizable(key, part.shape):
                    writer.add_group(zip((key, key + SCALE_SUFFIX), quantize_blockwise(part)))
                    continue
                writer.add(key, part)
                if part.dim() >= 2:
                    unquantized.append(key)
        if is_writer:
            writer.finish()
            quantization = block_fp8_config(unquantized) if fp8 is not None else None
            _write_side_files(model, tmp, dtype, source_dir, quantization, token_ids)
    if dist.is_initialized():
        dist.barrier()


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor ``full`` into ``param`` (only the local shard when ``param`` is a DTensor)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full.to(param.dtype))


def _saved_dtype(
    part: torch.Tensor, stored: torch.dtype | None, kept_fp32: bool, dtype: torch.dtype | None
) -> torch.dtype:
    """The dtype :func:`save_hf_weights` writes an HF tensor in: its source checkpoint's (``stored``), else fp32
    for a ``keep_fp32`` tensor, else ``dtype`` (``None``: as it is); non-floating tensors keep theirs."""
    if not part.is_floating_point():
        return part.dtype
    if stored is not None:
        return stored
    if kept_fp32:
        return torch.float32
    return dtype or part.dtype


def _write_side_files(
    model: CheckpointModel,
    out_dir: Path,
    dtype: torch.dtype | None,
    source_dir: str | Path | None,
    quantization: dict | None = None,
    token_ids: dict[str, Any] | None = None,
) -> None:
    hf_config = model.config.hf_config
    if dtype is not None:
        hf_config.dtype = str(dtype).removeprefix("torch.")
    if quantization is not None:
        hf_config.quantization_config = quantization
    text = hf_config.get_text_config()  # a vision-language config keeps them on its text config too
    for key, value in (token_ids or {}).items():
        for config in (hf_config,) if text is hf_config else (hf_config, text):
            if value is not None and getattr(config, key, None) is None:
                main = value[0] if isinstance(value, list) else value
                setattr(config, key, main)
    hf_config.save_pretrained(out_dir)
    if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
        copy_side_files(source_dir, out_dir, ["generation_config.json"])
    else:
        generation = GenerationConfig.from_model_config(hf_config)
        for key, value in (token_ids or {}).items():
            if value is not None:
                setattr(generation, key, value)
        if generation.to_diff_dict() != GenerationConfig().to_diff_dict():
            generation.save_pretrained(out_dir)
    copy_side_files(source_dir, out_dir)


def _mismatch_message(path: str | Path, missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    lines = [f"checkpoint {path} does not match the model:"]
    if missing:
        lines.append(
            f"  missing keys ({len(missing)}): " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        )
    if unexpected:
        lines.append(
            f"  unexpected keys ({len(unexpected)}): "
            + ", ".join(unexpected[:20])
            + (" ..." if len(unexpected) > 20 else "")
        )
    if mismatched:
        lines.append("  shape mismatches: " + "; ".join(mismatched))
    lines.append("  check that the checkpoint belongs to this model config (or load with strict=False).")
    return "\n".join(lines)
