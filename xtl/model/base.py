"""The model base: HF key map and layout hooks, checkpoint I/O entry points, initialization and sharding."""

from __future__ import annotations

import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xtl.batch import ModelOutput, SequenceContext
from xtl.model.config import TransformerConfig
from xtl.model.hf.format import DEFAULT_MAX_SHARD_SIZE
from xtl.model.hf.model_io import copy_into, load_hf_weights, save_hf_weights
from xtl.module.moe_block import MoEBlock
from xtl.module.norm import RMSNorm
from xtl.module.traits import AdapterModule, FusesProjections, KeepsFp32, SelfInitializing

if TYPE_CHECKING:
    from xtl.module.vision import VisionTower

SCORE_PREFIX = "score."  # transformers' sequence-classification head


class BaseModel(nn.Module, ABC):
    """Checkpoint I/O, initialization and sharding shared by all model families.

    Subclasses implement :meth:`forward`, :meth:`decoder_layers` and :meth:`text_model` (abstract: a family that
    lacks one cannot be built) and may override :meth:`to_hf_key_list`, :meth:`hf_to_param` and
    :meth:`param_to_hf` (tensor-layout hooks for HF tensors that differ by more than a name),
    :meth:`ignorable_hf_key` and :meth:`initializable_hf_key`.

    Attributes:
        config: The model's config.
    """

    config: TransformerConfig

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self._hf_path: Path | None = None
        self.hf_dtypes: dict[str, torch.dtype] = {}  # HF key -> dtype in the checkpoint loaded by from_hf

    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> ModelOutput:
        """Run the model (the family's call styles)."""

    # ---- HF key mapping -------------------------------------------------------------------------------------

    def to_hf_key_list(self, key: str) -> list[str]:
        """HF safetensors keys of the xtl parameter ``key`` (1 -> 1, or 1 -> N for fused parameters).

        The head of a sequence-classification model (``config.num_labels``) is transformers' ``score``.
        """
        if key.startswith("lm_head.") and self.config.num_labels:
            return [key.replace("lm_head.", SCORE_PREFIX, 1)]
        if self.config.tie_word_embeddings and key.startswith("lm_head."):
            key = key.replace("lm_head.", "embed_tokens.")
        return [key if key.startswith("lm_head.") else f"model.{key}"]

    def hf_keys(self, key: str) -> list[str]:
        """:meth:`to_hf_key_list` followed by the config's ``hf_key_mapping`` remaps.

        A fused projection's parameter (:meth:`fused_param_parts`) maps to the keys of its parts, in order.
        """
        parts = self.fused_param_parts(key)
        if parts:
            return [hf_key for part, _ in parts for hf_key in self.hf_keys(part)]
        keys = self.to_hf_key_list(key)
        for pattern, repl in self.config.hf_key_mapping.items():
            keys = [re.sub(pattern, repl, k) for k in keys]
        return keys

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Combine the HF tensors of ``key`` into the xtl parameter (default: concatenate on dim 0; a fused
        projection concatenates its parts' parameters)."""
        parts = self.fused_param_parts(key)
        if parts:
            pieces, start = [], 0
            for part, _ in parts:
                count = len(self.hf_keys(part))
                pieces.append(self.hf_to_param(part, tensors[start : start + count]))
                start += count
            return torch.cat(pieces, dim=0)
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Split the xtl parameter ``key`` into its HF tensors (inverse of :meth:`hf_to_param`)."""
        parts = self.fused_param_parts(key)
        if parts:
            pieces = tensor.split([rows for _, rows in parts], dim=0)
            return [hf.clone() for (part, _), piece in zip(parts, pieces) for hf in self.param_to_hf(part, piece)]
        n = len(self.to_hf_key_list(key))
        return [tensor] if n == 1 else list(tensor.chunk(n, dim=0))

    def fused_param_parts(self, key: str) -> tuple[tuple[str, int], ...]:
        """The parts of a fused projection's parameter ``key``: ``(unfused xtl key, rows)`` each, in row order;
        empty for any other key.

        A module declares its fused projections as a :class:`~xtl.module.traits.FusesProjections`, in its
        ``fused_parts`` dict, ``{child: ((part, rows), ...)}`` (e.g. ``qkv_proj`` of ``q_proj``, ``k_proj`` and
        ``v_proj``): ``layers.0.self_attn.qkv_proj.weight`` is ``layers.0.self_attn.q_proj.weight`` and so on,
        stacked on dim 0.
        """
        owner_path, _, rest = key.rpartition(".")
        owner_path, _, child = owner_path.rpartition(".")
        try:
            owner = self.get_submodule(owner_path) if owner_path else self
        except AttributeError:
            return ()
        parts = owner.fused_parts if isinstance(owner, FusesProjections) else {}
        if child not in parts:
            return ()
        prefix = f"{owner_path}." if owner_path else ""
        return tuple((f"{prefix}{part}.{rest}", rows) for part, rows in parts[child])

    def hf_matrix_rows(self, key: str, rows: int) -> tuple[int, ...]:
        """The rows of each HF matrix stacked in a matrix of parameter ``key`` (its last two dimensions, ``rows`` of
        them), in order: what a per-matrix optimizer (Muon) treats as separate matrices.

        A fused projection's parameter stacks its parts' matrices (:meth:`fused_param_parts`); any other
        parameter's matrices are HF's own (``(rows,)``) unless a family's key map splits them (routed experts'
        gate and up rows, where the checkpoint keeps them apart).
        """
        parts = self.fused_param_parts(key)
        if parts:
            return tuple(r for part, part_rows in parts for r in self.hf_matrix_rows(part, part_rows))
        return (rows,)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers that map to HF keys (tied parameters once).

        Parameters of adapter modules (:class:`~xtl.module.traits.AdapterModule`, e.g. LoRA factors) are not part
        of the HF model: see :meth:`adapter_tensors`.
        """
        adapters = self.adapter_tensors()
        tensors: dict[str, torch.Tensor] = {k: v for k, v in self.named_parameters() if k not in adapters}
        non_persistent = {
            f"{prefix}.{name}" if prefix else name
            for prefix, module in self.named_modules()
            for name in module._non_persistent_buffers_set
        }
        tensors.update({k: v for k, v in self.named_buffers() if k not in non_persistent})
        return tensors

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters of adapter modules (:class:`~xtl.module.traits.AdapterModule`): xtl-only weights with no HF
        key, initialized by their modules' ``init_param`` after every load or initialization of the model."""
        return {
            f"{prefix}.{name}" if prefix else name: param
            for prefix, module in self.named_modules()
            if isinstance(module, AdapterModule)
            for name, param in module.named_parameters(recurse=False)
        }

    # ---- loading --------------------------------------------------------------------------------------------

    def from_hf(self, hf_path: str | Path, strict: bool = True, device: torch.device | str | None = None) -> list[str]:
        """Load weights from an HF safetensors directory, reading only the keys this model needs.

        A model built on ``meta`` is materialized on ``device`` (default CPU) first. Sharded (DTensor) parameters
        receive only their local shard. See :func:`xtl.model.hf.load_hf_weights`.

        Args:
            hf_path: HF model directory.
            strict: Raise on missing or unexpected keys (shape mismatches always raise).
            device: Where to materialize a meta model.

        Returns:
            HF keys the model needed but the checkpoint lacks (empty when strict).

        Raises:
            CheckpointMismatchError: Naming every missing/unexpected key and every shape difference.
        """
        missing = load_hf_weights(self, hf_path, strict, device)
        self._hf_path = Path(hf_path)
        return missing

    def materialize(self, device: torch.device | str) -> None:
        """Allocate (uninitialized) storage for a meta-built model on ``device`` and restore weight tying."""
        self.to_empty(device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Re-establish parameter sharing that ``to_empty`` breaks (no-op unless a family ties weights)."""

    def ignorable_hf_key(self, key: str) -> bool:
        """Whether the checkpoint key ``key``, which no parameter of the model reads, may be left unread (rotary
        buffers, a tied head's own copy, a causal LM's head under a sequence-classification model's ``score``)."""
        head = key == "lm_head.weight" and (self.config.tie_word_embeddings or bool(self.config.num_labels))
        return key.endswith("rotary_emb.inv_freq") or head

    def initializable_hf_key(self, key: str) -> bool:
        """Whether the checkpoint key ``key``, which the model reads, may be absent, its tensor then initialized:
        a sequence-classification head (``score``) on a causal LM's checkpoint (a new head on a pretrained body)."""
        return bool(self.config.num_labels) and key.startswith(SCORE_PREFIX)

    # ---- saving ---------------------------------------------------------------------------------------------

    def save_hf(
        self,
        out_dir: str | Path,
        max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
        dtype: torch.dtype | None = None,
        fp8: str | None = None,
        tensor_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        token_ids: dict[str, Any] | None = None,
    ) -> None:
        """Write an HF model directory: shards, index, ``config.json``, generation config and tokenizer files.

        Under torch.distributed every rank must call this; rank 0 writes. The directory appears atomically. See
        :func:`xtl.model.hf.save_hf_weights`.

        Args:
            out_dir: Target directory (replaced if it exists).
            max_shard_size: Upper bound per shard with a unit, e.g. ``"5GB"`` or ``"4GiB"``.
            dtype: Cast floating-point tensors to this dtype (default: each tensor loaded by :meth:`from_hf` in
                the dtype its checkpoint stored it in; the others in the config's ``dtype`` if set, else their
                parameter's dtype). Tensors a module declares fp32 (:meth:`keep_fp32_names`) are written in fp32
                unless their source checkpoint stored them otherwise.
            fp8: ``"blockwise"`` writes the large linear weights as 128x128 block-quantized fp8 with
                ``_scale_inv`` scales and a ``quantization_config`` (the format of ``xtl convert to-fp8``).
            tensor_transform: Applied to each full tensor on every rank before it is written (e.g. merging LoRA
                adapters: :func:`xtl.model.hf.peft_adapter.merge_lora_transform`).
            token_ids: The tokenizer's special-token ids for ``config.json`` and ``generation_config.json``
                (:func:`xtl.train.generation.special_token_ids`).
        """
        save_hf_weights(
            self,
            out_dir,
            max_shard_size,
            dtype,
            source_dir=self._hf_path,
            fp8=fp8,
            tensor_transform=tensor_transform,
            token_ids=token_ids,
        )

    def keep_fp32_names(self) -> set[str]:
        """Checkpoint names that modules declare fp32 whatever the model dtype (the ``keep_fp32`` names of each
        :class:`~xtl.module.traits.KeepsFp32`)."""
        return {
            f"{prefix}.{attr}" if prefix else attr
            for prefix, module in self.named_modules()
            if isinstance(module, KeepsFp32)
            for attr in module.keep_fp32
        }

    # ---- init and sharding ----------------------------------------------------------------------------------

    def init_weights(self) -> None:
        """Initialize every weight (normal(0, initializer_range) for matrices, zeros for biases, ones for norms).

        A :class:`~xtl.module.traits.SelfInitializing` module initializes its own parameters. A model built on
        ``meta`` is materialized on CPU first.
        """
        if any(t.is_meta for t in self.checkpoint_tensors().values()):
            self.materialize("cpu")
        self.init_tensors([*self.checkpoint_tensors(), *self.adapter_tensors()])

    @torch.no_grad()
    def init_tensors(self, names: list[str]) -> None:
        """Initialize each named tensor from its own seed (base seed x name), on a full CPU copy.

        The values are therefore independent of initialization order and of how parameters are sharded: a model
        initialized on 1 rank equals the same model initialized under FSDP on N ranks.

        A fused projection's parameter is initialized part by part, each part from its own (unfused) name, so a
        model with ``fused_projections`` starts from the very weights of the model without.

        Args:
            names: Names of :meth:`checkpoint_tensors` or :meth:`adapter_tensors` (e.g. the ones a checkpoint
                lacks, and the adapters, after a load).
        """
        modules = dict(self.named_modules())
        tensors = {**self.checkpoint_tensors(), **self.adapter_tensors()}
        for name in names:
            module_name, _, attr = name.rpartition(".")
            module, tensor = modules[module_name], tensors[name]
            parts = self.fused_param_parts(name)
            if not parts:
                copy_into(tensor, self._init_tensor(name, module, attr, tensor.shape, tensor.dtype))
                continue
            shapes = [(rows, *tensor.shape[1:]) for _, rows in parts]
            pieces = [self._init_tensor(p, module, attr, s, tensor.dtype) for (p, _), s in zip(parts, shapes)]
            copy_into(tensor, torch.cat(pieces))

    def _init_tensor(
        self, name: str, module: nn.Module, attr: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A CPU tensor of ``shape`` initialized for ``module.<attr>`` from the seed of ``name``."""
        full = torch.empty(shape, dtype=dtype, device="cpu")
        std = self.config.initializer_range
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((torch.initial_seed() + zlib.crc32(name.encode())) % 2**63)
            if isinstance(module, SelfInitializing):
                module.init_param(attr, full, std)
            elif isinstance(module, RMSNorm):
                full.fill_(1.0)
            elif attr == "bias" or attr.endswith("_bias"):
                full.zero_()
            else:
                full.normal_(mean=0.0, std=std)
        return full

    # ---- parts ----------------------------------------------------------------------------------------------
    # Transforms and strategies find the model's parts through these typed accessors, never by attribute names:
    # a new family gets every callback by implementing them.

    @abstractmethod
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers of the language model, in order (each a :class:`~xtl.module.DecoderLayer`)."""

    def vision_blocks(self) -> nn.ModuleList | None:
        """The vision tower's blocks, in order (``None``: a text-only model)."""
        return None

    def vision_tower(self) -> VisionTower | None:
        """The vision tower (``None``: a text-only model)."""
        return None

    def attention_modules(self) -> list[nn.Module]:
        """The self-attention module of every decoder layer."""
        return [layer.self_attn for layer in self.decoder_layers()]

    def moe_blocks(self) -> list[MoEBlock]:
        """The mixture-of-experts feed-forwards of the decoder layers (empty for a dense model)."""
        return [layer.mlp for layer in self.decoder_layers() if isinstance(layer.mlp, MoEBlock)]

    def layer_stacks(self) -> dict[str, nn.ModuleList]:
        """The stacks of repeated blocks by part, in forward order: ``"vision"`` (vision-language models), then
        ``"language"`` (the decoder layers). Memory and speed transforms act on these blocks."""
        vision = self.vision_blocks()
        return {**({"vision": vision} if vision is not None else {}), "language": self.decoder_layers()}

    @abstractmethod
    def text_model(self) -> TextModel:
        """The language-model body (the model itself for a text model): embedding, decoder layers, final norm and
        the head with its ``head_loss``, by type (:class:`TextModel`)."""

    def fp32_modules(self) -> list[nn.Module]:
        """Modules that keep parameters in fp32 whatever the training dtype (their ``keep_fp32`` names)."""
        kept = [module for module in self.modules() if isinstance(module, KeepsFp32)]
        return [m for m in kept if any(isinstance(getattr(m, name), nn.Parameter) for name in m.keep_fp32)]

    def shard_units(self) -> list[nn.Module]:
        """The modules a sharding strategy wraps one by one before the root: every block of :meth:`layer_stacks`.

        What is not inside a unit (embeddings, final norm, head, a vision merger) belongs to the root unit.
        """
        return [block for stack in self.layer_stacks().values() for block in stack]

    def parameter_parts(self) -> dict[str, list[nn.Module]]:
        """The model's parts by name, each as the modules holding its parameters (every parameter in exactly one).

        A text model is one part, ``"language"``; a vision-language model adds ``"vision"`` (the tower) and
        ``"merger"``. Freezing (``model.init_args.freeze``) and per-part learning rates (``optimizer.lr_scales``)
        name these parts.
        """
        return {"language": [self]}

    def parameter_part_of(self) -> dict[int, str]:
        """``id(parameter) -> part name`` for every parameter (see :meth:`parameter_parts`)."""
        return {
            id(param): part
            for part, modules in self.parameter_parts().items()
            for module in modules
            for param in module.parameters()
        }

    def next_positions(self, seq_ctx: SequenceContext) -> torch.Tensor:
        """``(B,)`` the position of the token that follows each document of the packed prompts ``seq_ctx`` (where
        cached decoding continues): the document's length, for a model whose positions count its tokens (a
        vision-language model's M-RoPE positions run behind the tokens after an image).

        Args:
            seq_ctx: Prompts laid end to end (with a vision-language model's images in ``extras``).
        """
        return torch.tensor(seq_ctx.lengths, device=seq_ctx.cu_seq_lens.device)

    @torch.no_grad()
    def update_router_bias(self, tokens_per_expert: torch.Tensor, lr: float | torch.Tensor) -> None:
        """Aux-loss-free balancing: move each router's correction bias towards balance (after an optimizer step).

        Routers without a correction bias are left alone (:meth:`~xtl.module.MoEBlock.update_router_bias`).

        Args:
            tokens_per_expert: ``(L, E)`` loads of the step, one row per block of :meth:`moe_blocks` (the
                ``extras["tokens_per_expert"]`` of the micro-batches, summed and all-reduced over data ranks).
            lr: Bias update speed (a tensor too: 0 on a skipped step, without reading it on the host).

        Raises:
            ValueError: The loads do not have one row per MoE block.
        """
        blocks = self.moe_blocks()
        if tokens_per_expert.shape[0] != len(blocks):
            raise ValueError(f"tokens_per_expert has {tokens_per_expert.shape[0]} rows for {len(blocks)} MoE layers")
        for block, loads in zip(blocks, tokens_per_expert):
            block.update_router_bias(loads, lr)

    @property
    def source_dir(self) -> Path | None:
        """The HF directory the weights were loaded from (``None``: initialized)."""
        return self._hf_path


class TextModel(BaseModel):
    """A decoder-only language model: what every family's :meth:`BaseModel.text_model` returns, its parts by type.

    Code that needs the embedding, the final norm or the head takes them from here and recognizes them by identity
    (``module is model.text_model().lm_head``), never by their names.

    Attributes:
        embed_tokens: The input embedding.
        layers: The decoder layers (:meth:`decoder_layers`).
        norm: The final norm.
        lm_head: The output head (its weight is ``embed_tokens.weight`` when the config ties them).
    """

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear

    def decoder_layers(self) -> nn.ModuleList:
        """``layers``."""
        return self.layers

    def text_model(self) -> TextModel:
        """The model itself."""
        return self

    @abstractmethod
    def head_loss(
        self, hidden: torch.Tensor, targets: torch.Tensor | None, return_logits: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """LM head and loss of final hidden states: ``(logits, loss, loss_sum, num_tokens)``."""


__all__ = ["BaseModel", "TextModel"]


def has_fused_projections(model: nn.Module) -> bool:
    """Whether a module of ``model`` fuses projections (a :class:`~xtl.module.traits.FusesProjections` with
    ``fused_parts``; see :meth:`BaseModel.fused_param_parts`)."""
    return any(isinstance(module, FusesProjections) and module.fused_parts for module in model.modules())
