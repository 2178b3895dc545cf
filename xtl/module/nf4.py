"""4-bit NormalFloat (NF4) frozen base weights for QLoRA, stored as torchao's ``NF4Tensor``.

QLoRA (Dettmers et al., 2023) keeps the frozen base weights of a LoRA model in NF4: each block of
:data:`BLOCK_SIZE` consecutive weights (row-major) is scaled by its absolute maximum and every weight is rounded to
the nearest of 16 code values (the quantiles of a standard normal, normalized to ``[-1, 1]``, with an exact zero);
the per-block scalers are quantized again to int8 in groups of :data:`SCALER_BLOCK_SIZE` around their mean (double
quantization). A weight costs ``4 + 8 / 64 + 32 / (64 * 256)`` bits, about 4.127.

The quantizer, the storage and the matmul are torchao's (``torchao.quantization.NF4Tensor``, CPU and CUDA).
:func:`quantize_linear` swaps an ``nn.Linear``'s weight for a frozen ``NF4Tensor`` parameter under the same name;
``nn.Linear.forward`` then calls ``F.linear(x, weight)``, which torchao dispatches to ``linear_nf4``: the weight
is dequantized to the input's dtype (the autocast dtype under mixed precision) for the matmul, and backward returns
the gradient of the input only. Weights are quantized from fp32 whatever the parameter dtype, so the code values
and the scalers keep full precision.

torchao requires the element count of a weight to be a multiple of ``BLOCK_SIZE * SCALER_BLOCK_SIZE`` (16384);
:func:`nf4_incompatibility` says why a layer does not qualify. bitsandbytes is not used.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from xtl.errors import ConfigError

if TYPE_CHECKING:
    from torchao.quantization import NF4Tensor

BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
QUANTIZE_BASE = ("nf4",)


def _torchao_nf4() -> tuple[type, object]:
    """torchao's ``NF4Tensor`` class and ``to_nf4`` (imported on first use: ``pip install xtl[lora]``)."""
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError as exc:  # pragma: no cover - torchao is a dev and lora dependency
        raise ConfigError(f"QLoRA (NF4 base weights) needs torchao: pip install 'xtl[lora]' ({exc})") from None
    return NF4Tensor, to_nf4


def is_nf4(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is an NF4-quantized tensor (torchao's ``NF4Tensor``), without importing torchao: before
    torchao's quantization package is imported no such tensor exists."""
    if tensor is None or "torchao.quantization" not in sys.modules:
        return False
    return isinstance(tensor, _torchao_nf4()[0])


def nf4_incompatibility(layer: nn.Module) -> str | None:
    """Why ``layer``'s weight cannot be stored in NF4 (``None`` when it can).

    Args:
        layer: The linear layer.

    Returns:
        A short reason, or ``None``.
    """
    weight = layer.weight
    if is_nf4(weight):
        return "already NF4"
    if type(layer).forward is not nn.Linear.forward:
        return f"{type(layer).__name__} has its own forward (only plain nn.Linear layers dispatch to the NF4 matmul)"
    if weight.dim() != 2:
        return f"its weight has {weight.dim()} dimensions (NF4 weights are matrices)"
    group = BLOCK_SIZE * SCALER_BLOCK_SIZE
    if weight.numel() % group:
        return (
            f"its weight of shape {tuple(weight.shape)} has {weight.numel()} elements, not a multiple of {group} "
            f"(NF4 blocks of {BLOCK_SIZE} weights, scalers double-quantized in groups of {SCALER_BLOCK_SIZE})"
        )
    return None


@torch.no_grad()
def quantize_linear(layer: nn.Linear) -> None:
    """Replace ``layer.weight`` by a frozen NF4 parameter of the same name (quantized from fp32, on its device).

    Args:
        layer: A plain ``nn.Linear`` whose weight passes :func:`nf4_incompatibility`.

    Raises:
        ConfigError: The weight is a sharded DTensor (FSDP), on ``meta``, or incompatible.
    """
    _refuse_sharded(layer.weight)
    if layer.weight.is_meta:
        raise ConfigError("QLoRA quantizes loaded weights: the layer is still on the meta device")
    reason = nf4_incompatibility(layer)
    if reason is not None:
        raise ConfigError(f"cannot store this layer's weight in NF4: {reason}")
    _, to_nf4 = _torchao_nf4()
    weight = layer.weight.detach().float().contiguous()
    layer.weight = nn.Parameter(to_nf4(weight, BLOCK_SIZE, SCALER_BLOCK_SIZE), requires_grad=False)


def dequantize(tensor: NF4Tensor) -> torch.Tensor:
    """The NF4 tensor's values as a plain fp32 tensor (code value x dequantized block scaler)."""
    return tensor.get_original_weight().float()


def nf4_codebook(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 NF4 code values torchao quantizes to (ascending, fp32; torchao stores them rounded to 4 decimals)."""
    _, to_nf4 = _torchao_nf4()
    values = torch.linspace(-1.0, 1.0, BLOCK_SIZE * SCALER_BLOCK_SIZE, device=device)
    return to_nf4(values, BLOCK_SIZE, SCALER_BLOCK_SIZE).nf4


def nf4_nbytes(tensor: NF4Tensor) -> int:
    """Bytes an NF4 tensor stores: packed 4-bit codes, int8 scalers, fp32 scaler factors and mean, code values."""
    names, _ = tensor.__tensor_flatten__()
    return sum(getattr(tensor, name).numel() * getattr(tensor, name).element_size() for name in names)


def nf4_error_bound(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise bound of ``|dequantize(to_nf4(tensor)) - tensor|`` (fp32, ``tensor``'s shape).

    Within a block of absolute maximum ``a``, a weight ``w`` is rounded to the code value nearest to ``w / a``,
    at most half the largest gap ``g`` between neighbouring code values away; the scaler ``a`` itself comes back
    from int8 with an error of at most ``c / 128``, where ``c`` is the largest ``|a_i - mean(a)|`` of its group of
    256 scalers (a rounding step is ``2c / 256``, and clamping the top value to 127 costs a whole step). With
    ``|code| <= 1`` the bound is ``a * g / 2 + c / 128``.

    Args:
        tensor: The unquantized tensor (numel a multiple of 16384).

    Returns:
        The bound per element.
    """
    codes = nf4_codebook(tensor.device).float()
    gap = (codes[1:] - codes[:-1]).max()
    blocks = tensor.detach().float().reshape(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)
    centered = (absmax - absmax.mean()).reshape(-1, SCALER_BLOCK_SIZE)
    scaler_error = centered.abs().amax(dim=1, keepdim=True).expand_as(centered).reshape(-1) / 128
    bound = absmax * gap / 2 + scaler_error
    return bound[:, None].expand_as(blocks).reshape(tensor.shape)


def quantize_frozen_linears(model: nn.Module, layers: list[tuple[str, nn.Linear]]) -> tuple[list[str], dict[str, str]]:
    """Store the frozen weights of ``layers`` in NF4 where they qualify.

    Args:
        model: The model (for the error message only).
        layers: ``(name, layer)`` pairs to quantize.

    Returns:
        The names quantized, and ``{name: reason}`` for the layers left in their dtype.

    Raises:
        ConfigError: A layer's weight trains (QLoRA quantizes frozen weights only) or is sharded.
    """
    quantized: list[str] = []
    skipped: dict[str, str] = {}
    for name, layer in layers:
        _refuse_sharded(layer.weight)
        if layer.weight.requires_grad:
            raise ConfigError(f"QLoRA quantizes frozen weights; {name}.weight of {type(model).__name__} trains")
        reason = nf4_incompatibility(layer)
        if reason is not None:
            skipped[name] = reason
            continue
        quantize_linear(layer)
        quantized.append(name)
    return quantized, skipped


def quantize_base_weights(model: nn.Module, all_linear: bool = False, head: nn.Module | None = None) -> str:
    """QLoRA: store the frozen base weights of the adapted layers (``all_linear``: of every frozen linear layer but
    the LM head) in NF4; layers whose shape NF4 cannot store stay in their dtype.

    Args:
        model: A loaded model with LoRA adapters (:mod:`xtl.module.lora`).
        all_linear: Quantize every frozen ``nn.Linear`` except the LM head, adapted or not (adapter factors never).
        head: The model's LM head (``BaseModel.text_model().lm_head``), which ``all_linear`` leaves out.

    Returns:
        A one-line summary to log (what was quantized, what was left and why).

    Raises:
        ConfigError: No layer qualifies, a chosen weight trains, or the weights are sharded.
        ValueError: ``all_linear`` without the ``head``.
    """
    from xtl.module.lora import LoRAProjection, lora_layers

    if all_linear:
        if head is None:
            raise ValueError("quantize_base_weights(all_linear=True) needs the model's head, to leave it out")
        layers = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not isinstance(module, LoRAProjection) and module is not head
        ]
    else:
        layers = list(lora_layers(model))
    if not layers:
        raise ConfigError(f"QLoRA: {type(model).__name__} has no LoRA-adapted linear layer to quantize")
    quantized, skipped = quantize_frozen_linears(model, layers)
    if not quantized:
        name, reason = next(iter(skipped.items()))
        raise ConfigError(f"QLoRA: no linear layer's weight can be stored in NF4 (e.g. {name}: {reason})")
    nbytes = sum(nf4_nbytes(model.get_submodule(name).weight) for name in quantized)
    numel = sum(model.get_submodule(name).weight.numel() for name in quantized)
    summary = (
        f"QLoRA: {len(quantized)} linear layers store their base weights in NF4 ({8 * nbytes / numel:.3f} bits/param)"
    )
    if skipped:
        name, reason = next(iter(skipped.items()))
        summary += f"; {len(skipped)} stay in their dtype, e.g. {name}: {reason}"
    return summary


def _refuse_sharded(weight: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        raise ConfigError(
            "QLoRA (callbacks/qlora.yaml) does not support sharded (FSDP) weights yet: train QLoRA on one device "
            "or drop the QLoRA callback"
        )


__all__ = [
    "BLOCK_SIZE",
    "QUANTIZE_BASE",
    "SCALER_BLOCK_SIZE",
    "dequantize",
    "is_nf4",
    "nf4_codebook",
    "nf4_error_bound",
    "nf4_incompatibility",
    "nf4_nbytes",
    "quantize_base_weights",
    "quantize_frozen_linears",
    "quantize_linear",
]
