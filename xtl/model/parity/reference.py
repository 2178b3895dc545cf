"""The reference of a parity check: transformers' eager model, loaded from an HF directory or HF-keyed tensors
(:func:`load_reference`) or filled with an xtl model's current weights (:func:`build_reference`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from xtl.model.base import BaseModel


def load_reference(
    source: str | Path | Mapping[str, torch.Tensor],
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[PreTrainedModel | None, list[str]]:
    """transformers' eager model for ``hf_config`` (eager attention and experts), loaded by transformers itself:
    its causal-LM class, or its image-text-to-text class for a vision-language config (e.g.
    ``Qwen3VLForConditionalGeneration``).

    Args:
        source: An HF model directory, or HF-keyed tensors (checkpoint layout).
        hf_config: The config (its ``num_hidden_layers`` may be smaller than the checkpoint's).
        dtype: Parameter dtype (transformers keeps its fp32-by-design tensors in fp32).
        device: Where the model runs.

    Returns:
        The model in eval mode (``None`` if it could not be loaded) and the loading problems (missing, unexpected
        and misshapen keys), empty when every weight matched.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    mapping = next(
        (m for m in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING) if type(hf_config) in m), None
    )
    if mapping is None:
        raise ValueError(
            f"transformers has no causal-LM or image-text-to-text class for {type(hf_config).__name__}: no reference"
        )
    model_class = mapping[type(hf_config)]
    config = copy.deepcopy(hf_config)
    is_path = isinstance(source, (str, Path))
    kwargs = {"state_dict": dict(source)} if not is_path else {}
    try:
        with _quiet_transformers():
            model, info = model_class.from_pretrained(
                str(source) if is_path else None,
                config=config,
                attn_implementation="eager",
                experts_implementation="eager",
                dtype=dtype,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below as load errors
                **kwargs,
            )
    except (RuntimeError, ValueError, KeyError) as err:  # e.g. a size mismatch
        return None, [f"{type(err).__name__}: {err}".splitlines()[0]]
    errors = []
    unexpected = sorted(info.get("unexpected_keys", ()))
    if is_path:  # a checkpoint may hold more layers than asked for, or extra modules (e.g. MTP)
        unexpected = []
    for what, keys in (
        ("missing keys", sorted(info.get("missing_keys", ()))),
        ("unexpected keys", unexpected),
        ("size mismatches", sorted(_mismatch(k) for k in info.get("mismatched_keys", ()))),
    ):
        if keys:
            errors.append(f"{what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")
    return model.to(device).eval(), errors


def build_reference(
    model: BaseModel,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_layers: int | None = None,
) -> tuple[PreTrainedModel | None, list[str]]:
    """The reference filled with ``model``'s current weights through its HF key map.

    Collective under torch.distributed: every rank gathers each sharded tensor in turn (one full tensor at a
    time); rank 0 keeps the HF-keyed tensors (on CPU) and builds the reference, the others return ``(None, [])``.

    Args:
        model: The xtl model (plain or FSDP2/DTensor-sharded).
        hf_config: transformers config of the model.
        dtype: Reference parameter dtype.
        device: Where the reference runs.
        max_layers: Build only the first decoder layers.
    """
    main = is_main()
    layers = model.decoder_layers()
    keep_layers = len(layers) if max_layers is None else min(max_layers, len(layers))
    left_out = {id(t) for layer in layers[keep_layers:] for t in (*layer.parameters(), *layer.buffers())}
    keep_fp32 = model.keep_fp32_names()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.checkpoint_tensors().items():
        if id(tensor) in left_out:  # a tensor of a decoder layer the reference does not build
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if not main:
            continue
        if full.is_floating_point() and name not in keep_fp32:
            full = full.to(dtype)
        for key, part in zip(model.hf_keys(name), model.param_to_hf(name, full)):
            state[key] = part.to("cpu", copy=True)
    if not main:
        return None, []
    return load_reference(state, truncated_hf_config(hf_config, keep_layers), dtype, device)


def truncated_hf_config(hf_config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """A copy of ``hf_config`` with only its first ``num_layers`` decoder layers (per-layer lists cut too; of a
    vision-language config, its ``text_config``'s)."""
    whole = copy.deepcopy(hf_config)
    config = whole.get_text_config(decoder=True)
    if num_layers < config.num_hidden_layers:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types[:num_layers])
    return whole


def is_main() -> bool:
    """Rank 0 of a distributed run, or a single process (the one that builds and runs the reference)."""
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _mismatch(entry: Any) -> str:
    """``key (given [a, b], expected [c, d])`` from transformers' ``(key, given shape, expected shape)``."""
    if isinstance(entry, tuple) and len(entry) == 3:
        return f"{entry[0]} (given {list(entry[1])}, expected {list(entry[2])})"
    return str(entry)
