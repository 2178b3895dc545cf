"""Base config and model: what every xtl model shares (HF config round trip, checkpoint I/O, init, sharding)."""

from __future__ import annotations

import dataclasses
import json
import re
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import GenerationConfig, PretrainedConfig

from xtl.batch import ModelOutput, SequenceContext
from xtl.model.hf.loader import HFCheckpointLoader
from xtl.model.hf.saver import ShardWriter, copy_side_files
from xtl.module.norm import RMSNorm
from xtl.module.rope import RopeConfig
from xtl.utils import atomic_directory

# Config fields that are xtl's own: never read from or written to a transformers config by name.
_XTL_ONLY_FIELDS = {"rope", "attn_impl", "hf_key_mapping"}


class CheckpointMismatchError(ValueError):
    """A checkpoint does not match the model: missing or unexpected keys, or wrong shapes."""


@dataclass
class TransformerConfig:
    """Fields shared by every decoder-only model. Subclasses add their family's fields.

    Field names equal transformers' config field names wherever the meaning is the same, so that
    :meth:`from_hf` and :attr:`hf_config` are exact inverses by construction.

    Attributes:
        attn_impl: xtl attention implementation: ``auto``, ``eager``, ``sdpa`` or ``flash``.
        rope: Rotary settings (transformers' ``rope_parameters``).
        hf_key_mapping: Regex remaps applied to HF keys after ``to_hf_key_list`` (e.g. a text tower inside a VLM).
    """

    hf_config_class: ClassVar[type[PretrainedConfig]]
    hf_architecture: ClassVar[str]

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    attn_impl: str = "auto"
    hf_key_mapping: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if isinstance(self.rope, dict):
            self.rope = RopeConfig(**self.rope)
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).removeprefix("torch.")

    @property
    def model_type(self) -> str:
        """transformers' ``model_type`` of this family."""
        return self.hf_config_class.model_type

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim`` or ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf_path: str | Path) -> TransformerConfig:
        """Read ``config.json`` of an HF model directory (through transformers' own config class)."""
        return cls.from_hf_config(cls.hf_config_class.from_pretrained(str(hf_path)))

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> TransformerConfig:
        """Map a transformers config onto this class; fields absent from old checkpoints keep their defaults."""
        if hf_config.model_type != cls.hf_config_class.model_type:
            raise ValueError(
                f"{cls.__name__} reads model_type {cls.hf_config_class.model_type!r}, got {hf_config.model_type!r}"
            )
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in _XTL_ONLY_FIELDS and hasattr(hf_config, f.name):
                kwargs[f.name] = getattr(hf_config, f.name)
        kwargs["rope"] = RopeConfig.from_hf_config(hf_config)
        return cls(**kwargs)

    @property
    def hf_config(self) -> PretrainedConfig:
        """The transformers config equivalent to this one (inverse of :meth:`from_hf_config`)."""
        hf_fields = {f.name for f in dataclasses.fields(self.hf_config_class)}
        kwargs = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in hf_fields and f.name not in _XTL_ONLY_FIELDS
        }
        kwargs["rope_parameters"] = self.rope.to_hf()
        config = self.hf_config_class(**kwargs)
        config.architectures = [self.hf_architecture]
        if self.dtype is not None:
            config.dtype = self.dtype
        return config

    def build(self) -> BaseModel:
        """Build the model (a plain ``nn.Module``; works under ``torch.device('meta')``)."""
        raise TypeError(f"{type(self).__name__} is abstract; use a model family's config class")


class BaseModel(nn.Module):
    """Checkpoint I/O, initialization and sharding shared by all model families.

    Subclasses implement :meth:`forward` and may override :meth:`to_hf_key_list`, :meth:`hf_to_param` and
    :meth:`param_to_hf` (tensor-layout hooks for HF tensors that differ by more than a name).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self._hf_path: Path | None = None

    def forward(self, *args: Any, **kwargs: Any) -> ModelOutput:  # pragma: no cover - overridden
        raise TypeError(f"{type(self).__name__} does not define forward")

    # ---- HF key mapping -------------------------------------------------------------------------------------

    def to_hf_key_list(self, key: str) -> list[str]:
        """HF safetensors keys of the xtl parameter ``key`` (1 -> 1, or 1 -> N for fused parameters)."""
        if self.config.tie_word_embeddings and key.startswith("lm_head."):
            key = key.replace("lm_head.", "embed_tokens.")
        return [key if key.startswith("lm_head.") else f"model.{key}"]

    def hf_keys(self, key: str) -> list[str]:
        """:meth:`to_hf_key_list` followed by the config's ``hf_key_mapping`` remaps."""
        keys = self.to_hf_key_list(key)
        for pattern, repl in self.config.hf_key_mapping.items():
            keys = [re.sub(pattern, repl, k) for k in keys]
        return keys

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Combine the HF tensors of ``key`` into the xtl parameter (default: concatenate on dim 0)."""
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Split the xtl parameter ``key`` into its HF tensors (inverse of :meth:`hf_to_param`)."""
        n = len(self.to_hf_key_list(key))
        return [tensor] if n == 1 else list(tensor.chunk(n, dim=0))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers that map to HF keys (tied parameters once)."""
        tensors: dict[str, torch.Tensor] = dict(self.named_parameters())
        non_persistent = {
            f"{prefix}.{name}" if prefix else name
            for prefix, module in self.named_modules()
            for name in module._non_persistent_buffers_set
        }
        tensors.update({k: v for k, v in self.named_buffers() if k not in non_persistent})
        return tensors

    # ---- loading --------------------------------------------------------------------------------------------

    def from_hf(self, hf_path: str | Path, strict: bool = True, device: torch.device | str | None = None) -> list[str]:
        """Load weights from an HF safetensors directory, reading only the keys this model needs.

        A model built on ``meta`` is materialized on ``device`` (default CPU) first. Sharded (DTensor) parameters
        receive only their local shard.

        Args:
            hf_path: HF model directory.
            strict: Raise on missing or unexpected keys (shape mismatches always raise).
            device: Where to materialize a meta model.

        Returns:
            HF keys the model needed but the checkpoint lacks (empty when strict).

        Raises:
            CheckpointMismatchError: Naming every missing/unexpected key and every shape difference.
        """
        loader = HFCheckpointLoader(hf_path)
        tensors = self.checkpoint_tensors()
        if any(t.is_meta for t in tensors.values()):
            self.materialize(device or "cpu")
            tensors = self.checkpoint_tensors()
        missing: list[str] = []
        mismatched: list[str] = []
        consumed: set[str] = set()
        missing_params: list[str] = []
        for name, param in tensors.items():
            keys = self.hf_keys(name)
            absent = [k for k in keys if k not in loader]
            if absent:
                missing.extend(absent)
                missing_params.append(name)
                continue
            consumed.update(keys)
            full = self.hf_to_param(name, [loader.load(k) for k in keys])
            if tuple(full.shape) != tuple(param.shape):
                mismatched.append(
                    f"{name} (from {', '.join(keys)}): checkpoint {tuple(full.shape)}, model {tuple(param.shape)}"
                )
                continue
            _copy_into(param, full)
        unexpected = sorted(k for k in set(loader.keys()) - consumed if not self._ignorable_hf_key(k))
        loader.close()
        if mismatched or (strict and (missing or unexpected)):
            raise CheckpointMismatchError(_mismatch_message(hf_path, missing, unexpected, mismatched))
        if missing_params:
            self._init_named(missing_params)
        self._hf_path = Path(hf_path)
        return missing

    def materialize(self, device: torch.device | str) -> None:
        """Allocate (uninitialized) storage for a meta-built model on ``device`` and restore weight tying."""
        self.to_empty(device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Re-establish parameter sharing that ``to_empty`` breaks (no-op unless a family ties weights)."""

    def _ignorable_hf_key(self, key: str) -> bool:
        return key.endswith("rotary_emb.inv_freq") or (self.config.tie_word_embeddings and key == "lm_head.weight")

    # ---- saving ---------------------------------------------------------------------------------------------

    def save_hf(
        self, out_dir: str | Path, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None
    ) -> None:
        """Write an HF model directory: shards, index, ``config.json``, generation config and tokenizer files.

        Under torch.distributed every rank must call this (sharded tensors are gathered one at a time); rank 0
        writes. The directory appears atomically (temp dir, then rename).

        Args:
            out_dir: Target directory (replaced if it exists).
            max_shard_size: Upper bound per shard, e.g. ``"5GB"``.
            dtype: Cast floating-point tensors to this dtype (default: the config's ``dtype`` -- the source
                checkpoint's -- if set, else the parameter dtypes). Tensors a module declares in its ``keep_fp32``
                attribute are always written in fp32.
        """
        if dtype is None and self.config.dtype is not None:
            dtype = getattr(torch, self.config.dtype)
        is_writer = not dist.is_initialized() or dist.get_rank() == 0
        with atomic_directory(out_dir) if is_writer else nullcontext(None) as tmp:
            writer = ShardWriter(tmp, max_shard_size) if is_writer else None
            keep_fp32 = self._keep_fp32_names()
            for name, tensor in self.checkpoint_tensors().items():
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
                if not is_writer:
                    continue
                if name in keep_fp32:
                    full = full.float()
                elif dtype is not None and full.is_floating_point():
                    full = full.to(dtype)
                for key, part in zip(self.hf_keys(name), self.param_to_hf(name, full)):
                    writer.add(key, part)
            if is_writer:
                writer.finish()
                self._write_side_files(tmp, dtype)
        if dist.is_initialized():
            dist.barrier()

    def _keep_fp32_names(self) -> set[str]:
        """Checkpoint names that modules declare fp32 whatever the model dtype (``keep_fp32`` attribute names)."""
        return {
            f"{prefix}.{attr}" if prefix else attr
            for prefix, module in self.named_modules()
            for attr in getattr(module, "keep_fp32", ())
        }

    def _write_side_files(self, out_dir: Path, dtype: torch.dtype | None) -> None:
        hf_config = self.config.hf_config
        if dtype is not None:
            hf_config.dtype = str(dtype).removeprefix("torch.")
        hf_config.save_pretrained(out_dir)
        src = self._hf_path
        if src is not None and (src / "generation_config.json").is_file():
            copy_side_files(src, out_dir, ["generation_config.json"])
        else:
            generation = GenerationConfig.from_model_config(hf_config)
            if generation.to_diff_dict() != GenerationConfig().to_diff_dict():
                generation.save_pretrained(out_dir)
        copy_side_files(src, out_dir)

    # ---- init and sharding ----------------------------------------------------------------------------------

    def init_weights(self) -> None:
        """Initialize every weight (normal(0, initializer_range) for matrices, zeros for biases, ones for norms).

        A module with an ``init_param(attr, tensor, std)`` method initializes its own parameters. A model built
        on ``meta`` is materialized on CPU first.
        """
        if any(t.is_meta for t in self.checkpoint_tensors().values()):
            self.materialize("cpu")
        self._init_named(list(self.checkpoint_tensors()))

    @torch.no_grad()
    def _init_named(self, names: list[str]) -> None:
        """Initialize each named tensor from its own seed (base seed x name), on a full CPU copy.

        The values are therefore independent of initialization order and of how parameters are sharded: a model
        initialized on 1 rank equals the same model initialized under FSDP on N ranks.
        """
        std = self.config.initializer_range
        base_seed = torch.initial_seed()
        modules = dict(self.named_modules())
        tensors = self.checkpoint_tensors()
        for name in names:
            module_name, _, attr = name.rpartition(".")
            module, tensor = modules[module_name], tensors[name]
            full = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((base_seed + zlib.crc32(name.encode())) % 2**63)
                if hasattr(module, "init_param"):
                    module.init_param(attr, full, std)
                elif isinstance(module, RMSNorm):
                    full.fill_(1.0)
                elif attr == "bias" or attr.endswith("_bias"):
                    full.zero_()
                else:
                    full.normal_(mean=0.0, std=std)
            _copy_into(tensor, full)

    def fully_shard(
        self,
        mesh: Any,
        mp_policy: Any | None = None,
        reshard_after_forward: bool = True,
        offload_policy: Any | None = None,
    ) -> BaseModel:
        """Shard with FSDP2: each decoder layer, then the root (embeddings, final norm, head).

        Args:
            mesh: The data-parallel ``DeviceMesh`` (1-D shard, or 2-D replicate x shard for HSDP).
            mp_policy: ``MixedPrecisionPolicy`` or ``None``.
            reshard_after_forward: Free gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2).
            offload_policy: Optional ``CPUOffloadPolicy``.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": mp_policy or MixedPrecisionPolicy(),
            "offload_policy": offload_policy or OffloadPolicy(),
        }
        for layer in self.layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
        fully_shard(self, reshard_after_forward=reshard_after_forward, **kwargs)
        return self


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full.to(param.dtype))


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


def read_hf_config_dict(hf_path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` of an HF model directory as a dict (clear error when missing or malformed)."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {hf_path} a Hugging Face model directory?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from err


__all__ = [
    "BaseModel",
    "CheckpointMismatchError",
    "ModelOutput",
    "SequenceContext",
    "TransformerConfig",
    "read_hf_config_dict",
]
