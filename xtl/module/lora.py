"""Low-rank adapters on ``nn.Linear`` layers, attached in place (parameter names of the base layer unchanged).

A target layer ``proj`` gets two child projections, ``proj.lora_A`` ``(r, in)`` and ``proj.lora_B`` ``(out, r)``,
a dropout and a forward hook that adds ``lora_B(lora_A(dropout(x))) * scaling`` to the layer's output: the
parameter names are PEFT's (``...q_proj.lora_A.weight``), the base weight keeps its own (``...q_proj.weight``), so HF
checkpoints load by name as before. The math is PEFT's LoRA (``scaling = alpha / r``, or ``alpha / sqrt(r)`` with
rsLoRA; ``B`` starts at zero so the adapted model starts equal to the base model).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.module.traits import AdapterModule

LORA_INITS = ("kaiming", "gaussian")


class LoRAProjection(AdapterModule, nn.Linear):
    """One factor of an adapter (``lora_A`` or ``lora_B``): a bias-free linear layer with no HF key.

    An :class:`~xtl.module.traits.AdapterModule`: these weights are not part of the HF model; they are neither
    loaded from nor written to HF safetensors, and they initialize themselves through :meth:`init_param`.

    Args:
        in_features: Input width.
        out_features: Output width.
        role: ``"A"`` (down projection, random init) or ``"B"`` (up projection, zeros).
        init: ``kaiming`` (PEFT's default: Kaiming-uniform ``A``) or ``gaussian`` (``A ~ N(0, 1/r)``).
    """

    def __init__(self, in_features: int, out_features: int, role: str, init: str = "kaiming", **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias=False, **kwargs)
        self.role = role
        self.init = init

    def init_param(self, attr: str, tensor: torch.Tensor, std: float) -> None:
        """Fill ``tensor`` (this factor's full weight, on CPU) as PEFT does; ``std`` (the model's) is unused."""
        if self.role == "B":
            tensor.zero_()
        elif self.init == "gaussian":
            tensor.normal_(mean=0.0, std=1.0 / self.out_features)
        else:
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))


def add_lora(
    layer: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False, init: str = "kaiming"
) -> None:
    """Attach an adapter to ``layer`` in place (on the layer's device, ``meta`` included).

    Args:
        layer: The ``nn.Linear`` to adapt.
        rank: Adapter rank ``r``.
        alpha: Scale numerator (``lora_alpha``).
        dropout: Dropout on the adapter's input (training only).
        use_rslora: ``scaling = alpha / sqrt(r)`` instead of ``alpha / r``.
        init: ``kaiming`` or ``gaussian`` initialization of ``lora_A``.
    """
    if init not in LORA_INITS:
        raise ValueError(f"LoRA init must be one of {LORA_INITS}, got {init!r}")
    factory = {"device": layer.weight.device, "dtype": layer.weight.dtype}
    if not layer.weight.is_floating_point():  # a quantized base weight: adapters in the compute dtype
        factory["dtype"] = torch.float32
    layer.lora_A = LoRAProjection(layer.in_features, rank, "A", init, **factory)
    layer.lora_B = LoRAProjection(rank, layer.out_features, "B", init, **factory)
    layer.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    layer.lora_scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    layer.lora_enabled = True
    layer.lora_use_start = False
    layer.lora_start = None  # (A, B) kept by keep_starting_adapters
    layer.register_forward_hook(_add_adapter_output)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """``(name, layer)`` of every adapted layer of ``model``: the modules whose children include adapter factors."""
    for name, module in model.named_modules():
        if lora_factors(module):
            yield name, module


def lora_factors(layer: nn.Module) -> dict[str, LoRAProjection]:
    """The adapter factors of ``layer`` by child name (``{"lora_A": ..., "lora_B": ...}``, PEFT's key parts; empty
    for a layer without an adapter)."""
    return {name: child for name, child in layer.named_children() if isinstance(child, LoRAProjection)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, every adapted layer of ``model`` computes its base output only (the adapters stay in place,
    untouched): the base model, e.g. the reference of preference optimization, without a second copy of it."""
    with _layers_set(model, "lora_enabled", False):
        yield


def keep_starting_adapters(model: nn.Module) -> None:
    """Remember the current factors of every adapted layer of ``model`` as its starting adapters (full tensors, on
    the factors' device; a sharded factor is gathered, so every rank calls this), for :func:`starting_adapters`."""
    for _, layer in lora_layers(model):
        layer.lora_start = tuple(_full(factor.weight).detach().clone() for factor in (layer.lora_A, layer.lora_B))


@contextmanager
def starting_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block, every adapted layer of ``model`` computes with the adapters remembered by
    :func:`keep_starting_adapters` (frozen: no gradient reaches them; no dropout), and with none where nothing was
    remembered: the starting policy of a run that continues from a trained adapter, without a second copy of the
    model or an in-place change of the trained factors (a pending backward still sees them unchanged)."""
    with _layers_set(model, "lora_use_start", True):
        yield


def merged_weight(layer: nn.Linear, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """``weight + scaling * B @ A`` in fp32, cast back to ``weight``'s dtype (full, unsharded tensors)."""
    delta = (lora_b.float() @ lora_a.float()) * layer.lora_scaling
    return (weight.float() + delta).to(weight.dtype)


def _add_adapter_output(layer: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    if not layer.lora_enabled:
        return output
    x = args[0]
    dtype = layer.lora_A.weight.dtype  # the compute dtype (a sharded factor is gathered in it)
    x = x.to(dtype) if not torch.is_autocast_enabled(x.device.type) else x
    if layer.lora_use_start:
        if layer.lora_start is None:
            return output
        start_a, start_b = (factor.to(dtype) for factor in layer.lora_start)
        return output + F.linear(F.linear(x, start_a), start_b) * layer.lora_scaling
    return output + layer.lora_B(layer.lora_A(layer.lora_dropout(x))) * layer.lora_scaling


@contextmanager
def _layers_set(model: nn.Module, flag: str, value: bool) -> Iterator[None]:
    """Every adapted layer's ``flag`` set to ``value`` within the block, back to ``not value`` after."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        setattr(layer, flag, value)
    try:
        yield
    finally:
        for layer in layers:
            setattr(layer, flag, not value)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
