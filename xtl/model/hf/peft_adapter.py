"""LoRA adapters in PEFT's format: key mapping, ``adapter_config.json``, saving, loading and the merged export.

A PEFT LoRA adapter directory holds ``adapter_config.json`` (rank, alpha, target modules, ...) and
``adapter_model.safetensors`` with one ``lora_A``/``lora_B`` pair per adapted module, named after the HF module
path: ``base_model.model.<HF module path>.lora_A.weight``. xtl adapts a linear layer in place
(:mod:`xtl.module.lora`); its HF module path is the HF key of its ``weight`` (the model's key map) without the
``.weight`` suffix. Under torch.distributed every rank calls the save and merge functions (sharded factors are
gathered one at a time) and rank 0 writes; loading copies each rank's local shard.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.errors import ConfigError
from xtl.model.hf.errors import CheckpointFormatError, CheckpointMismatchError
from xtl.model.hf.model_io import copy_into
from xtl.model.hf.writer import save_shard
from xtl.module.lora import lora_factors, lora_layers, merged_weight
from xtl.module.traits import AdapterModule
from xtl.utils import atomic_directory

if TYPE_CHECKING:
    from xtl.model.base import BaseModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

# adapter_config.json settings xtl's LoRA cannot reproduce: key -> (is the value unsupported?, what to do)
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "peft_type": (lambda v: v != "LORA", "xtl loads LoRA adapters only (peft_type LORA)"),
    "bias": (lambda v: v not in (None, "none"), "trainable biases are not supported; use bias 'none'"),
    "lora_bias": (bool, "trainable biases of lora_B are not supported"),
    "fan_in_fan_out": (bool, "transposed (Conv1D) base layers are not supported"),
    "modules_to_save": (bool, "fully trained extra modules are not supported"),
    "use_dora": (bool, "DoRA is not supported"),
    "use_qalora": (bool, "QA-LoRA is not supported"),
    "rank_pattern": (bool, "per-module ranks are not supported; all adapted modules must share r"),
    "alpha_pattern": (bool, "per-module alphas are not supported; all adapted modules must share lora_alpha"),
    "layers_to_transform": (lambda v: v is not None, "layer selection is not supported; use target_modules"),
    "layers_pattern": (lambda v: v is not None, "layer selection is not supported; use target_modules"),
    "exclude_modules": (bool, "exclude_modules is not supported; list the targets in target_modules"),
    "target_parameters": (bool, "adapters on bare parameters (target_parameters) are not supported"),
    "trainable_token_indices": (bool, "trainable token embeddings are not supported"),
    "layer_replication": (bool, "layer replication is not supported"),
    "init_lora_weights": (
        lambda v: isinstance(v, str) and v.lower().startswith(("pissa", "olora", "corda", "loftq")),
        "this initialization changes the base weights; convert the adapter to a plain LoRA first "
        "(PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))",
    ),
}


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """Read and check a PEFT LoRA ``adapter_config.json``.

    Args:
        adapter_dir: The adapter directory.

    Returns:
        The file's settings (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``use_rslora``, ...).

    Raises:
        ConfigError: The file is missing or not JSON, or a setting (named with the file) is not supported.
    """
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"LoRA.adapter_path: {path} does not exist; give a PEFT adapter directory "
            f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    for key, (unsupported, hint) in _UNSUPPORTED.items():
        if unsupported(config.get(key)):
            raise ConfigError(f"{path}: {key}={config[key]!r} is not supported: {hint}")
    targets = config.get("target_modules")
    if not targets or not isinstance(targets, (str, list)):
        raise ConfigError(f"{path}: target_modules must be a non-empty list of module names or a regex string")
    rank, dropout = config.get("r"), config.get("lora_dropout", 0.0)
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{path}: r must be an integer >= 1, got {rank!r}")
    if not isinstance(config.get("lora_alpha"), (int, float)):
        raise ConfigError(f"{path}: lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{path}: lora_dropout must be in [0, 1), got {dropout!r}")
    return config


def hf_module_path(model: BaseModel, name: str) -> str:
    """HF module path of the xtl linear layer ``name`` (``layers.0.self_attn.q_proj`` ->
    ``model.layers.0.self_attn.q_proj``): the HF key of its weight without ``.weight``.

    Raises:
        ConfigError: The weight maps to several HF tensors or to no ``.weight`` key.
    """
    keys = model.hf_keys(f"{name}.weight")
    if len(keys) != 1 or not keys[0].endswith(".weight"):
        raise ConfigError(f"LoRA layer {name}: its weight maps to HF keys {keys}, not to one HF linear layer")
    return keys[0].removesuffix(".weight")


def peft_target_matches(targets: list[str] | str, path: str) -> bool:
    """PEFT's ``target_modules`` rule on an HF module path: a regex string must match the whole path; a list
    entry must equal the path or be its dotted suffix (``q_proj``, ``self_attn.q_proj``); ``all-linear`` matches
    every path (the caller leaves out the output layer)."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith(f".{t}") for t in targets)


def peft_module_paths(model: BaseModel) -> dict[str, str]:
    """``{xtl layer name: HF module path}`` of every adapted layer.

    Raises:
        ConfigError: An adapted layer's weight is tied to another tensor (it has no HF linear of its own) or does
            not map to one HF linear layer.
    """
    tensors = model.checkpoint_tensors()
    paths = {}
    for name, _ in lora_layers(model):
        if f"{name}.weight" not in tensors:
            raise ConfigError(
                f"LoRA layer {name}: its weight is tied to another tensor, so the adapter cannot be exported; "
                "leave it out of LoRA.target_modules"
            )
        paths[name] = hf_module_path(model, name)
    return paths


def peft_target_modules(model: BaseModel, paths: dict[str, str] | None = None) -> list[str]:
    """PEFT ``target_modules`` that select exactly the adapted layers: the last parts of their HF module paths
    (``q_proj``), or the full paths when a last part also names a linear layer without adapter."""
    paths = peft_module_paths(model) if paths is None else paths
    last = {p.rsplit(".", 1)[-1] for p in paths.values()}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name in paths or isinstance(module, AdapterModule):
            continue
        try:
            other = hf_module_path(model, name)
        except ConfigError:  # no HF linear of its own
            continue
        if other.rsplit(".", 1)[-1] in last:
            return sorted(paths.values())
    return sorted(last)


def save_peft_adapter(
    model: BaseModel,
    out_dir: str | Path,
    config: dict[str, Any],
    source_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) atomically.

    Under torch.distributed every rank must call this (each sharded factor is gathered); rank 0 writes.

    Args:
        model: A model with LoRA layers.
        out_dir: Target directory (replaced if it exists).
        config: ``adapter_config.json`` content (``LoRA.adapter_config``); ``base_model_name_or_path`` and
            ``revision`` are set here.
        source_dir: The HF directory of the base model, recorded (absolute) as ``base_model_name_or_path``
            (``null`` when the model was not loaded from one).
        dtype: Dtype of the written factors (default: the parameters').
    """
    paths = peft_module_paths(model)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model):
        for factor, projection in lora_factors(layer).items():
            full = _full(projection.weight)
            if is_writer:
                state[f"{PEFT_PREFIX}{paths[name]}.{factor}.weight"] = full.to(dtype) if dtype is not None else full
    if is_writer:
        source = str(Path(source_dir).resolve()) if source_dir else None
        content = {**config, "base_model_name_or_path": source, "revision": None}
        with atomic_directory(out_dir) as tmp:
            save_shard(tmp / ADAPTER_WEIGHTS, state)
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    if dist.is_initialized():
        dist.barrier()


def load_peft_adapter(model: BaseModel, adapter_dir: str | Path) -> None:
    """Copy the factors of a PEFT adapter into the model's LoRA layers (each rank its local shard).

    Args:
        model: A model whose LoRA layers are the adapter's modules (same ranks), weights already materialized.
        adapter_dir: The adapter directory.

    Raises:
        FileNotFoundError: ``adapter_model.safetensors`` is absent.
        CheckpointMismatchError: Keys missing or unexpected, or shapes differ (the first ones named).
        CheckpointFormatError: The file is not a safetensors file.
    """
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        bin_hint = " (adapter_model.bin is not read; re-save it with safe_serialization=True)"
        raise FileNotFoundError(f"{path} does not exist{bin_hint if path.with_suffix('.bin').is_file() else ''}")
    paths = peft_module_paths(model)
    params = {
        f"{PEFT_PREFIX}{paths[name]}.{factor}.weight": projection.weight
        for name, layer in lora_layers(model)
        for factor, projection in lora_factors(layer).items()
    }
    try:
        with safe_open(str(path), framework="pt") as file:
            keys = set(file.keys())
            missing, unexpected = sorted(set(params) - keys), sorted(keys - set(params))
            mismatched = []
            if not missing and not unexpected:
                for key, param in params.items():
                    tensor = file.get_tensor(key)
                    if tuple(tensor.shape) != tuple(param.shape):
                        mismatched.append(f"{key}: adapter {tuple(tensor.shape)}, model {tuple(param.shape)}")
                        continue
                    copy_into(param, tensor)
    except SafetensorError as err:
        raise CheckpointFormatError(f"{path}: not a safetensors file ({err})") from None
    if missing or unexpected or mismatched:
        lines = [f"adapter {path} does not match the model's LoRA layers:"]
        for what, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shapes", mismatched)):
            if items:
                lines.append(f"  {what} ({len(items)}): " + ", ".join(items[:5]) + (" ..." if len(items) > 5 else ""))
        lines.append("  check that the adapter was trained on this model (same architecture, r and target_modules)")
        raise CheckpointMismatchError("\n".join(lines))


def merge_peft_adapter(model: BaseModel, adapter_dir: str | Path) -> int:
    """Merge a PEFT LoRA adapter into the weights of ``model`` (which has no LoRA layers of its own): each adapted
    linear layer's weight becomes ``W + scaling * B @ A`` (fp32 math, fp64 for an fp64 model, cast back to ``W``'s
    dtype), as PEFT's
    ``merge_and_unload`` computes it. Under torch.distributed every rank calls it (sharded weights are gathered one at
    a time) and keeps its shard.

    Args:
        model: The model, weights loaded.
        adapter_dir: The adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Returns:
        The number of merged layers.

    Raises:
        ConfigError: The adapter's config is missing or unsupported, or it targets no linear layer of ``model``.
        CheckpointMismatchError: Factors missing, unexpected or of the wrong shape.
    """
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    layers: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            try:
                layers[hf_module_path(model, name)] = module
            except ConfigError:  # no HF linear of its own
                continue
    try:
        with safe_open(str(path), framework="pt") as file:
            keys = set(file.keys())
            paths = {k.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for k in keys}
            unknown = sorted(p for p in paths if p not in layers)
            if unknown:
                raise CheckpointMismatchError(
                    f"adapter {path} adapts {unknown[0]}, which is not a linear layer of {type(model).__name__}; "
                    "check that the adapter was trained on this model"
                )
            for module_path in sorted(paths):
                layer = layers[module_path]
                lora_a = file.get_tensor(f"{PEFT_PREFIX}{module_path}.lora_A.weight")
                lora_b = file.get_tensor(f"{PEFT_PREFIX}{module_path}.lora_B.weight")
                if lora_a.shape != (rank, layer.in_features) or lora_b.shape != (layer.out_features, rank):
                    raise CheckpointMismatchError(
                        f"adapter {path}: {module_path} factors {tuple(lora_a.shape)} and {tuple(lora_b.shape)} do "
                        f"not fit a ({layer.out_features}, {layer.in_features}) layer of rank {rank}"
                    )
                full = _full(layer.weight)
                math = torch.promote_types(full.dtype, torch.float32)  # fp32, or fp64 for an fp64 model
                delta = (lora_b.to(math) @ lora_a.to(math)) * scaling
                copy_into(layer.weight, (full.to(math) + delta.to(full.device)).to(full.dtype))
    except SafetensorError as err:
        raise CheckpointFormatError(f"{path}: not a safetensors file ({err})") from None
    except KeyError as err:
        raise CheckpointMismatchError(f"adapter {path}: a factor is missing ({err})") from None
    return len(paths)


def merge_lora_transform(model: BaseModel) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """The ``tensor_transform`` of :func:`~xtl.model.hf.model_io.save_hf_weights` that writes merged weights.

    Each adapted layer's full weight becomes ``W + scaling * B @ A`` (fp32 math, cast back to ``W``'s dtype);
    the factors are gathered on every rank (call the transform on every rank). ``None`` without LoRA layers.

    Raises:
        ConfigError: An adapted layer's weight is tied to another tensor (merging would change both).
    """
    paths = peft_module_paths(model)  # checks that every adapted weight is a checkpoint tensor of its own
    if not paths:
        return None
    layers = {f"{name}.weight": layer for name, layer in lora_layers(model)}
    is_writer = not dist.is_initialized() or dist.get_rank() == 0

    def merge(name: str, full: torch.Tensor) -> torch.Tensor:
        layer = layers.get(name)
        if layer is None:
            return full
        lora_a, lora_b = _full(layer.lora_A.weight), _full(layer.lora_B.weight)  # collectives: every rank
        return merged_weight(layer, full, lora_a, lora_b) if is_writer else full

    return merge


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
