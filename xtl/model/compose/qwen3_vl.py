"""Qwen3-VL and Qwen3-VL-MoE: the vision tower, its merger, and an xtl Qwen3 / Qwen3-MoE language model.

The language model is xtl's :class:`~xtl.model.dense.Dense` / :class:`~xtl.model.moe.MoE` body with two changes
made by subclassing, not by branching in the shared bodies: interleaved M-RoPE (``rotary_emb``) and DeepStack
features added to the visual positions after the first decoder layers (``run_layers`` registers the additions as
forward hooks for the duration of one call).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from xtl.batch import ModelOutput, SequenceContext
from xtl.model.base import BaseModel, TextModel
from xtl.model.dense.dense import Dense
from xtl.model.moe.moe import MoE
from xtl.module.kv_cache import NO_KV_CACHE, KVCache
from xtl.module.mrope import MultimodalRotaryEmbedding
from xtl.module.vision import VisionTower
from xtl.ops.attention import AttentionMaskSpec

if TYPE_CHECKING:
    from xtl.model.compose.config import Qwen3VLConfig

_VL_EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up|down)")


class _DeepStackMixin:
    """M-RoPE and DeepStack injection for a text body (``Dense`` or ``MoE``)."""

    def _setup_vl(self) -> None:
        cfg = self.config
        self.rotary_emb = MultimodalRotaryEmbedding(
            cfg.resolved_head_dim, cfg.rope.rope_theta, cfg.rope.params.get("mrope_section", [24, 20, 20])
        )
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    @contextmanager
    def deepstack(self, visual_pos_mask: torch.Tensor | None, features: list[torch.Tensor]) -> Iterator[None]:
        """Within the block, add ``features[i]`` to the ``visual_pos_mask`` ``(B, T)`` positions after layer ``i``."""
        self._deepstack = None if visual_pos_mask is None else (visual_pos_mask, features)
        try:
            yield
        finally:
            self._deepstack = None

    def run_layers(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
        attention_mask: torch.Tensor | None,
        seq_ctx: SequenceContext | None,
        kv_cache: KVCache = NO_KV_CACHE,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The body's layers, with the DeepStack additions of the current call hooked onto the first layers."""
        handles = []
        if self._deepstack is not None:
            pos_mask, features = self._deepstack
            for i, feature in enumerate(features[: len(self.layers)]):  # a cut model: its layers only, as HF
                # eager inside a compiled layer: the masked update has a data-dependent number of rows
                add = torch.compiler.disable(_DeepStackAdd(pos_mask, feature))
                handles.append(self.layers[i].register_forward_hook(add))
        try:
            return super().run_layers(hidden, position_embeddings, mask, attention_mask, seq_ctx, kv_cache)
        finally:
            for handle in handles:
                handle.remove()


class _DeepStackAdd:
    """Forward hook: ``hidden[mask] += feature`` on a layer's output (transformers' ``_deepstack_process``)."""

    def __init__(self, pos_mask: torch.Tensor, feature: torch.Tensor) -> None:
        self.pos_mask, self.feature = pos_mask, feature

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
        mask = self.pos_mask.to(hidden.device)
        hidden = hidden.clone()
        hidden[mask, :] = hidden[mask, :] + self.feature.to(hidden.device, hidden.dtype)
        return hidden if rest is None else (hidden, *rest)


class Qwen3VLText(_DeepStackMixin, Dense):
    """The dense language model of Qwen3-VL: :class:`Dense` with M-RoPE and DeepStack."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._setup_vl()


class Qwen3VLMoeText(_DeepStackMixin, MoE):
    """The MoE language model of Qwen3-VL-MoE: :class:`MoE` with M-RoPE and DeepStack.

    Experts are one fused tensor per projection in the checkpoint: ``experts.gate_up_proj`` and
    ``experts.down_proj``, either in xtl's (and transformers' in-memory) ``(E, out, in)`` layout, as
    ``save_pretrained`` writes them, or transposed ``(E, in, out)``, as the released Qwen3-VL-MoE checkpoints
    store them (transformers accepts both). Loading detects the layout by shape and saving writes the layout that
    was loaded (the in-memory one for a fresh model), so a round trip is byte-identical. When ``2I == C`` the
    gate/up shape cannot tell the layouts apart and the in-memory layout is assumed.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._setup_vl()
        self._transposed_experts: set[str] = set()

    def to_hf_key_list(self, key: str) -> list[str]:
        """One fused HF tensor per expert projection."""
        match = _VL_EXPERT_KEY.fullmatch(key)
        if match is None:
            return Dense.to_hf_key_list(self, key)
        return [f"model.layers.{match[1]}.mlp.experts.{match[2]}_proj"]

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The HF expert tensor in xtl's ``(E, out, in)`` layout (transposed when stored ``(E, in, out)``)."""
        if _VL_EXPERT_KEY.fullmatch(key) is None:
            return Dense.hf_to_param(self, key, tensors)
        tensor = tensors[0]
        if tuple(tensor.shape) == tuple(self.get_parameter(key).shape):
            self._transposed_experts.discard(key)
            return tensor
        self._transposed_experts.add(key)
        return tensor.transpose(1, 2)

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of :meth:`hf_to_param` (the layout that was loaded)."""
        if _VL_EXPERT_KEY.fullmatch(key) is None:
            return Dense.param_to_hf(self, key, tensor)
        return [tensor.transpose(1, 2).contiguous() if key in self._transposed_experts else tensor]

    def hf_matrix_rows(self, key: str, rows: int) -> tuple[int, ...]:
        """An expert's ``gate_up`` matrix is one HF matrix (the fused ``gate_up_proj``)."""
        if _VL_EXPERT_KEY.fullmatch(key) is not None:
            return (rows,)
        return super().hf_matrix_rows(key, rows)


class Qwen3VL(BaseModel):
    """Vision tower (``visual``) + language model (``language_model``), as ``Qwen3VLForConditionalGeneration``.

    Two call styles (images only, no video yet):

    - HF-style ``model(input_ids=..., pixel_values=..., image_grid_thw=..., labels=...)`` on a ``(B, T)`` batch
      whose ``image_token_id`` placeholders receive the merged image tokens (in order), with M-RoPE positions from
      ``image_grid_thw`` (:meth:`get_rope_index`) unless ``position_ids`` ``(3, B, T)`` are given; unshifted labels.
    - Packed ``model(seq_ctx=..., labels=...)``: ``seq_ctx.extras`` carries ``pixel_values`` and
      ``image_grid_thw`` of the images of all its documents, in order of appearance (absent: a text-only pack);
      M-RoPE positions restart at every document; labels already shifted, as :class:`~xtl.model.dense.Dense`.
      A context-parallel share (``seq_ctx.pack_input_ids`` set) computes positions over the whole pack, encodes
      every image of the pack and keeps the positions and image features of its own tokens.
    """

    config: Qwen3VLConfig

    def __init__(self, config: Qwen3VLConfig) -> None:
        super().__init__(config)
        self.visual = VisionTower(config.vision_config)
        self.language_model = config.text_config.build()

    def tie_weights(self) -> None:
        """Tie the language model's head and embedding when the config says so."""
        self.language_model.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        seq_ctx: SequenceContext | None = None,
        return_logits: bool = True,
        return_hidden_states: bool = False,
        kv_cache: KVCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> ModelOutput:
        """Run vision tower, merger and language model (see the class docstring).

        Args:
            input_ids: ``(B, T)`` token ids with ``image_token_id`` placeholders.
            labels: Unshifted ``(B, T)`` labels, ``-100`` where no loss.
            inputs_embeds: ``(B, T, C)`` instead of ``input_ids`` (placeholders found as the embedding of
                ``image_token_id``, as transformers; pass ``position_ids`` for M-RoPE).
            attention_mask: ``(B, T)`` padding mask.
            position_ids: ``(3, B, T)`` M-RoPE or ``(B, T)`` positions (default: from ``image_grid_thw``).
            pixel_values: ``(sum(t*h*w), C * tp * p * p)`` flattened patches of all images, in order.
            image_grid_thw: ``(n_images, 3)`` patch grid of every image.
            mm_token_type_ids: ``(B, T)``, 1 at image tokens (default: derived from ``input_ids``).
            seq_ctx: A packed batch (images in ``extras``); excludes the HF-style arguments.
            return_logits: Keep logits in the output.
            return_hidden_states: Keep the final hidden states in the output.
            kv_cache: Keys and values of earlier calls (decoding; :meth:`Dense.forward`).
            logits_to_keep: Head only on the last ``n`` positions or on an index tensor (:meth:`Dense.forward`).
        """
        lm = self.language_model
        if seq_ctx is not None:
            if any(a is not None for a in (input_ids, inputs_embeds, attention_mask, position_ids, pixel_values)):
                raise ValueError("pass either seq_ctx or the HF-style arguments, not both")
            return self._forward_packed(seq_ctx, labels, return_logits, return_hidden_states, kv_cache, logits_to_keep)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("exactly one of input_ids and inputs_embeds must be given")
        if inputs_embeds is None:
            inputs_embeds = lm.embed_tokens(input_ids)
        merged = self._merge_images(input_ids, inputs_embeds, pixel_values, image_grid_thw)
        inputs_embeds, visual_mask, deepstack = merged
        if position_ids is None and input_ids is not None and image_grid_thw is not None:
            if mm_token_type_ids is None:
                mm_token_type_ids = (input_ids == self.config.image_token_id).int()
            position_ids = self.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, attention_mask)
        with lm.deepstack(visual_mask, deepstack):
            return lm(
                labels=labels,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                return_logits=return_logits,
                return_hidden_states=return_hidden_states,
                kv_cache=kv_cache,
                logits_to_keep=logits_to_keep,
            )

    def _forward_packed(
        self,
        seq_ctx: SequenceContext,
        labels: torch.Tensor | None,
        return_logits: bool,
        return_hidden_states: bool,
        kv_cache: KVCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> ModelOutput:
        lm = self.language_model
        input_ids = seq_ctx.input_ids
        inputs_embeds = lm.embed_tokens(input_ids) if seq_ctx.inputs_embeds is None else seq_ctx.inputs_embeds
        grid = seq_ctx.extras.get("image_grid_thw")
        share = None
        if seq_ctx.pack_input_ids is not None:  # a context-parallel share of the pack
            share = slice(seq_ctx.share_start, seq_ctx.share_start + seq_ctx.seq_len)
        inputs_embeds, visual_mask, deepstack = self._merge_images(
            input_ids, inputs_embeds, seq_ctx.extras.get("pixel_values"), grid, seq_ctx.pack_input_ids, share
        )
        position_ids = seq_ctx.position_ids
        if input_ids is not None:
            whole = input_ids if share is None else seq_ctx.pack_input_ids
            position_ids = self.packed_rope_index(whole, seq_ctx.cu_seq_lens, grid)
            position_ids = position_ids if share is None else position_ids[..., share]
        packed = replace(seq_ctx, input_ids=None, inputs_embeds=inputs_embeds, position_ids=position_ids)
        with lm.deepstack(visual_mask, deepstack):
            return lm(
                labels=labels,
                seq_ctx=packed,
                return_logits=return_logits,
                return_hidden_states=return_hidden_states,
                kv_cache=kv_cache,
                logits_to_keep=logits_to_keep,
            )

    def _merge_images(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pack_input_ids: torch.Tensor | None = None,
        share: slice | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Encode the images and scatter them into the placeholders; returns embeddings, visual mask, DeepStack.

        With ``share`` (the positions of ``input_ids`` in the whole pack ``pack_input_ids``), every image of the pack
        is encoded and the features of the placeholders inside the share are kept.

        Without images, a sharded vision tower still runs, on one blank image whose features are added times zero
        (:meth:`_take_part_without_images`).
        """
        if pixel_values is None:
            if self._vision_is_sharded():
                inputs_embeds = self._take_part_without_images(inputs_embeds)
            return inputs_embeds, None, []
        image_embeds, deepstack = self.visual(pixel_values, image_grid_thw)
        whole_mask = self.placeholder_mask(pack_input_ids if share is not None else input_ids, inputs_embeds)
        if int(whole_mask.sum()) != image_embeds.shape[0]:
            raise ValueError(
                f"{int(whole_mask.sum())} image tokens in the text but {image_embeds.shape[0]} image features"
            )
        visual_mask = whole_mask
        if share is not None:
            visual_mask = whole_mask[:, share]
            first = int(whole_mask[:, : share.start].sum())
            mine = slice(first, first + int(visual_mask.sum()))
            image_embeds, deepstack = image_embeds[mine], [feature[mine] for feature in deepstack]
        scatter_mask = visual_mask.unsqueeze(-1).expand_as(inputs_embeds)
        inputs_embeds = inputs_embeds.masked_scatter(scatter_mask, image_embeds.to(inputs_embeds.dtype))
        return inputs_embeds, visual_mask, deepstack

    def _vision_is_sharded(self) -> bool:
        """Whether FSDP2 shards the vision tower's parameters (the model or a module of the tower is an
        ``FSDPModule``; true whether or not they are gathered at the moment)."""
        return isinstance(self, FSDPModule) or any(isinstance(m, FSDPModule) for m in self.visual.modules())

    def _take_part_without_images(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """``inputs_embeds`` plus zero times the features of one blank image of the smallest grid (one merged token).

        Under sharded parameters every rank must run the vision tower in the same forwards: its units gather their
        parameters from every rank in the forward and reduce their gradients over every rank in the backward. A
        forward without images runs the tower (blocks, merger, DeepStack mergers) on a blank image and adds the sum
        of its features times zero: the values, and the gradients of everything but the tower, are unchanged
        (``x + 0`` is ``x``; the add passes its gradient through as is); the tower's gradients from it are zero.
        """
        merge = self.visual.spatial_merge_size
        device = inputs_embeds.device
        grid = torch.tensor([[1, merge, merge]], device=device)
        pixels = torch.zeros(merge * merge, math.prod(self.visual.patch_embed.shape), device=device)
        image_embeds, deepstack = self.visual(pixels, grid)
        total = image_embeds.sum() + sum(feature.sum() for feature in deepstack)
        return inputs_embeds + (total * 0).to(inputs_embeds.dtype)

    def placeholder_mask(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` bool, True at image placeholders (by id, or by embedding when only embeddings are given)."""
        if input_ids is not None:
            return input_ids == self.config.image_token_id
        token = torch.full((), self.config.image_token_id, dtype=torch.long, device=inputs_embeds.device)
        return (inputs_embeds == self.language_model.embed_tokens(token)).all(-1)

    def get_rope_index(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(3, B, T)`` M-RoPE positions: text advances all axes by 1; an image spans its merged ``(h, w)`` grid.

        After an image the next position is its start plus ``max(h, w) / spatial_merge_size`` (as transformers).
        Padding (``attention_mask == 0``) gets position 0.
        """
        position_ids = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=input_ids.device)
        grids = iter(image_grid_thw.tolist())
        for b in range(input_ids.shape[0]):
            types = mm_token_type_ids[b]
            if attention_mask is None:
                position_ids[:, b] = self._rope_positions(types, grids)
            else:
                keep = attention_mask[b].bool()
                position_ids[:, b, keep] = self._rope_positions(types[keep], grids)
        return position_ids

    def packed_rope_index(
        self, input_ids: torch.Tensor, cu_seq_lens: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """``(3, 1, T)`` M-RoPE positions of a ``(1, T)`` pack, restarting at every document."""
        types = (input_ids[0] == self.config.image_token_id).int()
        grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
        bounds = cu_seq_lens.tolist()
        pieces = [self._rope_positions(types[s:e], grids) for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(pieces, dim=1).to(input_ids.dtype).unsqueeze(1)

    def next_positions(self, seq_ctx: SequenceContext) -> torch.Tensor:
        """``(B,)`` the M-RoPE position after each prompt of the pack ``seq_ctx``: one past its largest position
        (transformers' ``rope_deltas`` added to the length); the tokens decoded after it take the same position on
        all three axes."""
        grid = seq_ctx.extras.get("image_grid_thw")
        positions = self.packed_rope_index(seq_ctx.input_ids, seq_ctx.cu_seq_lens, grid)
        bounds = seq_ctx.doc_bounds or tuple(seq_ctx.cu_seq_lens.tolist())
        return torch.stack([positions[:, 0, s:e].max() + 1 for s, e in zip(bounds[:-1], bounds[1:])])

    def _rope_positions(self, types: torch.Tensor, grids: Iterator[list[int]]) -> torch.Tensor:
        """``(3, n)`` positions of one sequence with token types ``types`` (0 text, 1 image), from 0."""
        merge = self.config.vision_config.spatial_merge_size
        pieces, pos = [], 0
        for kind, group in itertools.groupby(types.tolist()):
            n = len(list(group))
            if kind == 0:
                pieces.append(torch.arange(n, device=types.device).view(1, -1).expand(3, -1) + pos)
                pos += n
            else:
                t, h, w = next(grids)
                pieces.append(_image_positions(pos, t, h // merge, w // merge, types.device))
                pos += max(h, w) // merge
        return torch.cat(pieces, dim=1)

    # ---- HF key mapping -------------------------------------------------------------------------------------

    def to_hf_key_list(self, key: str) -> list[str]:
        """``visual.*`` -> ``model.visual.*``; the language model's keys move under ``model.language_model.``."""
        if key.startswith("visual."):
            return [f"model.{key}"]
        inner = self.language_model.to_hf_key_list(key.removeprefix("language_model."))
        return [k if k.startswith("lm_head.") else "model.language_model." + k.removeprefix("model.") for k in inner]

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The language model's layout hooks for its parameters."""
        if key.startswith("language_model."):
            return self.language_model.hf_to_param(key.removeprefix("language_model."), tensors)
        return super().hf_to_param(key, tensors)

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of :meth:`hf_to_param`."""
        if key.startswith("language_model."):
            return self.language_model.param_to_hf(key.removeprefix("language_model."), tensor)
        return super().param_to_hf(key, tensor)

    def hf_matrix_rows(self, key: str, rows: int) -> tuple[int, ...]:
        """The language model's split for its parameters."""
        if key.startswith("language_model."):
            return self.language_model.hf_matrix_rows(key.removeprefix("language_model."), rows)
        return super().hf_matrix_rows(key, rows)

    def ignorable_hf_key(self, key: str) -> bool:
        """Rotary buffers and a tied head's own copy."""
        return key.endswith("rotary_emb.inv_freq") or (self.config.tie_word_embeddings and key == "lm_head.weight")

    def decoder_layers(self) -> nn.ModuleList:
        """The language model's decoder layers."""
        return self.language_model.decoder_layers()

    def vision_blocks(self) -> nn.ModuleList:
        """The vision tower's blocks."""
        return self.visual.blocks

    def vision_tower(self) -> VisionTower:
        """The vision tower (``visual``)."""
        return self.visual

    def text_model(self) -> TextModel:
        """The language model (``language_model``)."""
        return self.language_model

    def parameter_parts(self) -> dict[str, list[nn.Module]]:
        """``vision`` (patch and position embeddings, blocks), ``merger`` (patch merger and DeepStack mergers) and
        ``language`` (the language model)."""
        mergers = [self.visual.merger, self.visual.deepstack_merger_list]
        tower = [m for m in self.visual.children() if all(m is not x for x in mergers)]
        return {"vision": tower, "merger": mergers, "language": [self.language_model]}


def _image_positions(start: int, t: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """``(3, t*h*w)`` positions of an image's merged tokens: ``start`` + (frame, row, column)."""
    grid_t, grid_h, grid_w = torch.meshgrid(
        torch.arange(t, device=device),
        torch.arange(h, device=device) + start,
        torch.arange(w, device=device) + start,
        indexing="ij",
    )
    positions = torch.stack([grid_t, grid_h, grid_w], dim=0).reshape(3, -1)
    positions[0] += start
    return positions


__all__ = ["Qwen3VL", "Qwen3VLMoeText", "Qwen3VLText"]
