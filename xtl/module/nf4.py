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

Sharded weights (FSDP2): a weight that is an FSDP ``DTensor`` sharded on its rows (``Shard(0)``, also under HSDP) is
quantized whole, once loaded, exactly as one process quantizes it, and each rank keeps the rows of its shard
(:func:`nf4_rows`): its 4-bit codes, its block scalers, the shared scaler mean, and one scaler factor per group of
blocks it holds. A shard that holds part of a group of 256 blocks stores that group's factor for its part
(torchao's scaler group is then the shard's part, e.g. 128 blocks), so its values, and the weight FSDP gathers
from the shards (torchao's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: codes, scalers and factors are
all-gathered, never dequantized), are bit for bit the values one process holds. The rows must split evenly over
the shard ranks (FSDP would pad them) into whole blocks of 64 weights; a layer whose shard would cut a block stays
in its dtype, with the reason. Under ``MixedPrecisionPolicy(param_dtype=bfloat16)`` the NF4 weight is gathered as
NF4 (the policy does not cast it) and dequantized to the input's dtype, bf16, in each matmul: the bf16 rounding of
the same fp32 values as under single-device ``bf16-mixed`` autocast.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

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
    """Whether ``tensor`` is an NF4-quantized tensor (torchao's ``NF4Tensor``, or a ``DTensor`` whose local shard is
    one), without importing torchao: before torchao's quantization package is imported no such tensor exists."""
    if tensor is None or "torchao.quantization" not in sys.modules:
        return False
    return isinstance(_local(tensor), _torchao_nf4()[0])


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
    if isinstance(weight, DTensor):
        return _shard_incompatibility(weight)
    return None


@torch.no_grad()
def quantize_linear(layer: nn.Linear, model: nn.Module | None = None) -> None:
    """Replace ``layer.weight`` by a frozen NF4 parameter of the same name (quantized from fp32, on its device).

    A weight sharded by FSDP2 is quantized whole and each rank keeps its rows (module docstring): every rank of the
    weight's mesh must call this, for the same layers in the same order.

    Args:
        layer: A plain ``nn.Linear`` whose weight passes :func:`nf4_incompatibility`.
        model: The FSDP-sharded model that holds ``layer`` (needed when the weight is sharded: its FSDP state is
            told about the new parameter).

    Raises:
        ConfigError: The weight is on ``meta``, incompatible, or sharded without FSDP managing it.
        ValueError: A sharded weight without ``model``.
    """
    if layer.weight.is_meta:
        raise ConfigError("QLoRA quantizes loaded weights: the layer is still on the meta device")
    reason = nf4_incompatibility(layer)
    if reason is not None:
        raise ConfigError(f"cannot store this layer's weight in NF4: {reason}")
    if isinstance(layer.weight, DTensor):
        if model is None:
            raise ValueError("quantize_linear of a sharded weight needs the FSDP-sharded model that holds the layer")
        _quantize_sharded(layer, _fsdp_params(model))
        return
    _, to_nf4 = _torchao_nf4()
    weight = layer.weight.detach().float().contiguous()
    layer.weight = nn.Parameter(to_nf4(weight, BLOCK_SIZE, SCALER_BLOCK_SIZE), requires_grad=False)


def nf4_rows(tensor: NF4Tensor, start: int, rows: int) -> NF4Tensor:
    """Rows ``start .. start + rows - 1`` of a 2-D NF4 tensor as an NF4 tensor of their own, with the same values.

    The rows' codes and block scalers are copied, with the scaler mean and the code values. Their scaler factors
    are those of the groups their blocks belong to, one per ``s = gcd(blocks, scaler_block_size)`` blocks, which
    becomes the new tensor's scaler group (``s`` divides both, so no group of ``s`` straddles two of the whole
    tensor's): a shard of 128 blocks keeps its half-group's factor. Shards of the same size have the same ``s``, so
    concatenating their codes, scalers and factors (FSDP's all-gather) gives an NF4 tensor with the values of the
    rows they cover.

    Args:
        tensor: The NF4 tensor (e.g. a whole weight quantized by one process).
        start: First row.
        rows: Number of rows; ``start`` and ``rows`` times the row length are multiples of :data:`BLOCK_SIZE`.

    Returns:
        The rows, on ``tensor``'s device.

    Raises:
        ValueError: The rows do not start or end on a block boundary, or ``start`` is not on a boundary of ``s``.
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

    cols = tensor.shape[1]
    first, numel = start * cols, rows * cols
    if first % tensor.block_size or numel % tensor.block_size or start < 0 or start + rows > tensor.shape[0]:
        raise ValueError(
            f"rows {start}..{start + rows - 1} of a {tuple(tensor.shape)} NF4 tensor do not cover whole blocks of "
            f"{tensor.block_size} weights"
        )
    block0, blocks = first // tensor.block_size, numel // tensor.block_size
    group = math.gcd(blocks, tensor.scaler_block_size)
    if block0 % group:
        raise ValueError(f"rows from {start} start inside a group of {group} scalers")
    owners = (block0 + torch.arange(0, blocks, group, device=tensor.device)) // tensor.scaler_block_size
    meta = SubclassTensorArgs(torch.Size((rows, cols)), (cols, 1), 0, tensor.dtype, tensor.device, False)
    return type(tensor)(
        meta,
        tensor.block_size,
        blocks,
        group,
        tensor.quantized_scalers[block0 : block0 + blocks].clone(),
        tensor.quantization_factor[owners].clone(),
        tensor.scaler_mean.clone(),
        tensor.quantized_data[first // 2 : (first + numel) // 2].clone(),
        tensor.nf4.clone(),
    )


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """The NF4 tensor's values as an fp32 tensor (code value x dequantized block scaler): a plain tensor, or for a
    sharded NF4 weight a ``DTensor`` of the same layout holding its shard's values (``full_tensor()`` gathers)."""
    if isinstance(tensor, DTensor):
        values = tensor.to_local().get_original_weight().float()
        return DTensor.from_local(
            values, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    return tensor.get_original_weight().float()


def nf4_codebook(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 NF4 code values torchao quantizes to (ascending, fp32; torchao stores them rounded to 4 decimals)."""
    _, to_nf4 = _torchao_nf4()
    values = torch.linspace(-1.0, 1.0, BLOCK_SIZE * SCALER_BLOCK_SIZE, device=device)
    return to_nf4(values, BLOCK_SIZE, SCALER_BLOCK_SIZE).nf4


def nf4_nbytes(tensor: torch.Tensor) -> int:
    """Bytes an NF4 tensor stores: packed 4-bit codes, int8 scalers, fp32 scaler factors and mean, code values (of a
    sharded NF4 weight: what this rank stores)."""
    tensor = _local(tensor)
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
        ConfigError: A layer's weight trains (QLoRA quantizes frozen weights only), or is sharded without FSDP.
    """
    quantized: list[str] = []
    skipped: dict[str, str] = {}
    managed: dict[tuple[int, str], Any] | None = None
    for name, layer in layers:
        if layer.weight.requires_grad:
            raise ConfigError(f"QLoRA quantizes frozen weights; {name}.weight of {type(model).__name__} trains")
        reason = nf4_incompatibility(layer)
        if reason is not None:
            skipped[name] = reason
            continue
        if isinstance(layer.weight, DTensor):
            managed = _fsdp_params(model) if managed is None else managed
            _quantize_sharded(layer, managed, name)
        else:
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
        ConfigError: No layer qualifies, or a chosen weight trains.
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
    weights = [model.get_submodule(name).weight for name in quantized]
    nbytes = sum(nf4_nbytes(weight) for weight in weights)
    numel = sum(_local(weight).numel() for weight in weights)
    summary = (
        f"QLoRA: {len(quantized)} linear layers store their base weights in NF4 ({8 * nbytes / numel:.3f} bits/param)"
    )
    if isinstance(weights[0], DTensor):
        summary += f", each sharded over {_shard_count(weights[0])} ranks"
    if skipped:
        name, reason = next(iter(skipped.items()))
        summary += f"; {len(skipped)} stay in their dtype, e.g. {name}: {reason}"
    return summary


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shard_count(weight: DTensor) -> int:
    """How many row shards ``weight``'s placements cut it into (the FSDP shard ranks; replicas do not count)."""
    return math.prod(weight.device_mesh.size(dim) for dim, p in enumerate(weight.placements) if p == Shard(0))


def _shard_incompatibility(weight: DTensor) -> str | None:
    """Why a sharded weight cannot be stored in NF4 shards (``None`` when it can): only row shards (FSDP's
    ``Shard(0)``, replicated under HSDP) that split the rows evenly into whole blocks of :data:`BLOCK_SIZE`."""
    if any(p != Shard(0) and not isinstance(p, Replicate) for p in weight.placements):
        return f"its weight is split as {weight.placements} (NF4 shards are row shards, FSDP's Shard(0))"
    ranks, (rows, cols) = _shard_count(weight), weight.shape
    if rows % ranks:
        return (
            f"its {rows} rows do not split evenly over the {ranks} ranks that shard it (FSDP would pad the NF4 "
            "shards); shard over a number of ranks that divides the rows"
        )
    if rows // ranks * cols % BLOCK_SIZE:
        return (
            f"a shard of {rows // ranks} x {cols} weights on each of the {ranks} ranks that shard it would cut NF4 "
            f"blocks of {BLOCK_SIZE} weights; shard over fewer ranks"
        )
    return None


def _fsdp_params(model: nn.Module) -> dict[tuple[int, str], tuple[Any, Any]]:
    """FSDP2's record of every parameter it manages in ``model``: ``{(id(module), name): (FSDPParamGroup,
    FSDPParam)}``."""
    from torch.distributed.fsdp import FSDPModule

    params = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    params[(id(param._module_info.module), param._module_info.param_name)] = (group, param)
    return params


def _quantize_sharded(
    layer: nn.Linear, managed: dict[tuple[int, str], tuple[Any, Any]], name: str = "the layer"
) -> None:
    """Quantize a loaded FSDP-sharded weight whole (a collective over its mesh) and keep this rank's rows, as a
    ``DTensor`` of the same layout, then tell FSDP the parameter changed (module docstring).

    On a one-rank shard group (FSDP on one device, or HSDP with ``data_parallel_shard_size: 1``) the rank holds the
    whole weight either way; torch 2.13's FSDP2 copies a single all-gather input there, not the three of an NF4
    tensor, so the weight leaves FSDP and stays a plain NF4 parameter (it has no gradient to reduce).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weight = layer.weight
    group, fsdp_param = managed.get((id(layer), "weight"), (None, None))
    if fsdp_param is None:
        raise ConfigError(f"QLoRA: {name}.weight is a DTensor that FSDP2 does not manage; NF4 shards need FSDP2")
    _, to_nf4 = _torchao_nf4()
    whole = to_nf4(weight.full_tensor().float().contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)
    if _shard_count(weight) == 1:
        group.fsdp_params.remove(fsdp_param)
        fsdp_param._post_load_hook_handle.remove()  # it would look for a DTensor at the module's weight
        layer.weight = nn.Parameter(whole, requires_grad=False)
        return
    (rows, _), (start, _) = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    local = nf4_rows(whole, start, rows)
    del whole
    sharded = DTensor.from_local(
        local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
    )
    layer.weight = nn.Parameter(sharded, requires_grad=False)
    _adopt(fsdp_param, local)


def _adopt(fsdp_param: Any, local: torch.Tensor) -> None:
    """Point FSDP2's record of a parameter at its new NF4 shard (torch 2.13's ``FSDPParam``; what torchtune gets by
    building NF4 weights before ``fully_shard``): ``reset_sharded_param`` takes the module's new parameter (it
    compares storages, which an NF4 wrapper has none of, so the flat shard is set first), and the all-gather goes
    through the tensor's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` only if FSDP knows it has them, which
    it decides at ``fully_shard`` time (``_init_extensions``)."""
    for attr in ("reset_sharded_param", "_init_extensions", "init_dtype_attrs", "mp_policy"):
        if not hasattr(fsdp_param, attr):  # pragma: no cover - a torch whose FSDP2 records parameters otherwise
            raise ConfigError(f"QLoRA under FSDP needs torch 2.13's FSDPParam.{attr}; this torch has none")
    fsdp_param._sharded_param_data = local.view(-1)
    fsdp_param.reset_sharded_param()
    fsdp_param._init_extensions()
    fsdp_param.init_dtype_attrs(fsdp_param.mp_policy)


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
    "nf4_rows",
    "quantize_base_weights",
    "quantize_frozen_linears",
    "quantize_linear",
]
