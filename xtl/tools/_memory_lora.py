"""LoRA / QLoRA terms of ``xtl memory``: which linear layers of a decoder layer are adapted, their adapter
parameters, NF4 storage and adapter activations.

The linear layers of a decoder layer and their ``(in, out)`` widths are read off :class:`~xtl.model.dims.ModelDims`
under the module names xtl's families give them (``self_attn.q_proj``, ``mlp.gate_proj``,
``mlp.shared_experts.down_proj``, MLA's ``self_attn.q_a_proj`` ...; routed experts are grouped tensors, not
``nn.Linear``, and are never adapted). A layer is a target when a pattern of ``target_modules`` matches its full
name (``layers.3.self_attn.q_proj``) or its last part, as :class:`xtl.callbacks.LoRA` matches them.

Per adapted layer of widths ``(in, out)`` and rank ``r``:

- adapter parameters ``r * (in + out)`` (``lora_A`` is ``r x in``, ``lora_B`` is ``out x r``), trained: gradients,
  fp32 master copy and two fp32 AdamW moments;
- QLoRA: the base weight in NF4 when ``in * out`` is a multiple of 16384 (torchao's blocks of 64 weights and groups
  of 256 scalers; others stay in their dtype), ``in * out / 2`` bytes of 4-bit codes, ``in * out / 64`` int8
  scalers, ``4 * in * out / 16384`` bytes of fp32 scaler factors, plus 68 bytes (fp32 scaler mean, 16 fp32 code
  values); each matmul dequantizes its weight through int64 codes and fp32 values, a working set of about 20 bytes
  per weight of the largest NF4 matrix. Sharded over ``S`` FSDP ranks (:mod:`xtl.module.nf4`), a weight is NF4 only
  when its ``out`` rows split evenly into whole blocks, and each rank stores its ``out / S`` rows: their codes and
  scalers, one factor per ``g = gcd(blocks, 256)`` of its ``blocks`` (a shard of half a group keeps that group's
  factor) and the 68 bytes; the gathered weight holds ``S`` times the codes, scalers and factors;
- activations per token: ``r`` (the ``lora_A`` output, kept by ``lora_B``). The layer input is kept as before (by
  ``lora_A`` now: a frozen base weight needs no input for its backward). Under selective recompute, which keeps
  every matmul output, ``r + out`` (the ``lora_B`` output too).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass

from xtl.model.dims import ModelDims

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``xtl.callbacks.LoRA``'s default ``target_modules`` (kept equal by the tests)."""

NF4_GROUP = 64 * 256  # elements of a weight must be a multiple of BLOCK_SIZE * SCALER_BLOCK_SIZE
NF4_DEQUANT_BYTES = 20  # working set per element of torchao's NF4 dequantization (int64 codes, fp32 values)


def layer_linears(dims: ModelDims, layer: int) -> dict[str, tuple[int, int, str]]:
    """The ``nn.Linear`` layers of decoder layer ``layer``: ``{name: (in, out, block)}``, ``block`` ``attn`` or
    ``mlp``, names relative to the layer as xtl builds them.

    Args:
        dims: The model's dimensions.
        layer: Layer index.

    Returns:
        The linear layers (routed experts are not ``nn.Linear`` and are left out).
    """
    d, h, a = dims, dims.hidden_size, dims.num_heads
    if d.is_mla:
        attn = {}
        if d.q_lora_rank:
            attn["self_attn.q_a_proj"] = (h, d.q_lora_rank)
            attn["self_attn.q_b_proj"] = (d.q_lora_rank, a * d.qk_head_dim)
        else:
            attn["self_attn.q_proj"] = (h, a * d.qk_head_dim)
        attn["self_attn.kv_a_proj_with_mqa"] = (h, d.kv_lora_rank + d.qk_rope_head_dim)
        attn["self_attn.kv_b_proj"] = (d.kv_lora_rank, a * (d.qk_nope_head_dim + d.v_head_dim))
        attn["self_attn.o_proj"] = (a * d.v_head_dim, h)
    else:
        qd, kd = a * d.head_dim, d.num_kv_heads * d.head_dim
        attn = {"self_attn.q_proj": (h, qd), "self_attn.k_proj": (h, kd), "self_attn.v_proj": (h, kd)}
        attn["self_attn.o_proj"] = (qd, h)
    if not d.is_moe_layer(layer):
        prefix, width = "mlp.", d.intermediate_size
    else:
        prefix, width = "mlp.shared_experts.", d.shared_intermediate_size
    mlp = {}
    if width:
        mlp = {f"{prefix}gate_proj": (h, width), f"{prefix}up_proj": (h, width), f"{prefix}down_proj": (width, h)}
    return {name: (i, o, "attn") for name, (i, o) in attn.items()} | {
        name: (i, o, "mlp") for name, (i, o) in mlp.items()
    }


def matches(name: str, targets: Sequence[str]) -> bool:
    """Whether the module ``name`` is a LoRA target: a pattern matches the full name or its last part."""
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in targets)


def nf4_bytes(numel: int) -> int:
    """Bytes torchao's ``NF4Tensor`` stores for a weight of ``numel`` elements (quantized from fp32)."""
    return numel // 2 + numel // 64 + 4 * (numel // NF4_GROUP) + 4 + 16 * 4


def nf4_shards(fan_in: int, fan_out: int, shard: int) -> bool:
    """Whether a weight of ``fan_out`` rows of ``fan_in`` can be stored in NF4 sharded over ``shard`` ranks (a
    multiple of 16384 weights, rows split evenly into whole blocks of 64)."""
    return fan_in * fan_out % NF4_GROUP == 0 and fan_out % shard == 0 and fan_out // shard * fan_in % 64 == 0


def nf4_shard_bytes(fan_in: int, fan_out: int, shard: int) -> tuple[int, int]:
    """Bytes of an NF4 weight sharded over ``shard`` ranks (:func:`nf4_shards` holds): ``(one rank's shard, the
    gathered weight)``; ``shard = 1``: :func:`nf4_bytes` twice."""
    numel = fan_in * fan_out // shard
    blocks = numel // 64
    factors = blocks // math.gcd(blocks, 256)
    return numel // 2 + blocks + 4 * factors + 4 + 16 * 4, shard * (numel // 2 + blocks + 4 * factors) + 4 + 16 * 4


@dataclass
class BlockLoRA:
    """LoRA figures of one block (attention or MLP) of one decoder layer (full tensors, before tensor parallelism).

    Attributes:
        adapted: Names of the adapted linear layers.
        adapter_params: ``r * (in + out)`` summed over the adapted layers.
        adapter_outputs: ``out`` summed over the adapted layers (the ``lora_B`` outputs).
        nf4_numel: Weights stored in NF4.
        nf4_bytes: Their storage (gathered: whole weights).
        largest_nf4: Elements of the largest NF4 weight (0 without one).
        nf4_shard_bytes: What one rank stores of them (``nf4_bytes`` unsharded).
    """

    adapted: list[str]
    adapter_params: int = 0
    adapter_outputs: int = 0
    nf4_numel: int = 0
    nf4_bytes: int = 0
    largest_nf4: int = 0
    nf4_shard_bytes: int = 0


def block_lora(
    dims: ModelDims, layer: int, rank: int, targets: Sequence[str], qlora: bool, all_linear: bool, shard: int = 1
) -> dict[str, BlockLoRA]:
    """LoRA figures of the attention and MLP blocks of decoder layer ``layer``.

    Args:
        dims: The model's dimensions.
        layer: Layer index.
        rank: Adapter rank.
        targets: ``target_modules`` patterns.
        qlora: Base weights in NF4 (of the adapted layers; ``all_linear``: of every linear layer).
        all_linear: With ``qlora``, quantize every linear layer of the decoder layer, adapted or not.
        shard: FSDP ranks the weights are sharded over (1: whole weights).

    Returns:
        ``{"attn": ..., "mlp": ...}``.
    """
    blocks = {"attn": BlockLoRA([]), "mlp": BlockLoRA([])}
    for name, (fan_in, fan_out, which) in layer_linears(dims, layer).items():
        block, adapted = blocks[which], matches(f"layers.{layer}.{name}", targets)
        if adapted:
            block.adapted.append(name)
            block.adapter_params += rank * (fan_in + fan_out)
            block.adapter_outputs += fan_out
        if qlora and (adapted or all_linear) and nf4_shards(fan_in, fan_out, shard):
            stored, gathered = nf4_shard_bytes(fan_in, fan_out, shard)
            block.nf4_numel += fan_in * fan_out
            block.nf4_bytes += gathered
            block.nf4_shard_bytes += stored
            block.largest_nf4 = max(block.largest_nf4, fan_in * fan_out)
    return blocks


__all__ = [
    "DEFAULT_TARGETS",
    "NF4_DEQUANT_BYTES",
    "BlockLoRA",
    "block_lora",
    "layer_linears",
    "matches",
    "nf4_bytes",
    "nf4_shard_bytes",
    "nf4_shards",
]
