"""Run both sides of a parity check on the same documents and compare what they computed, row by row.

:func:`run_xtl` and :func:`run_reference` record the hidden states (forward hooks; for a vision-language model
the vision tower's too, :func:`vision_modules`), logits, loss and gradients of each side into a :class:`Capture`;
:func:`compare_captures` turns two captures into :class:`ParityRow` s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.batch import SequenceContext
from xtl.model.parity.documents import ParityDocuments
from xtl.model.parity.presets import ParityTolerance
from xtl.model.parity.report import ParityRow
from xtl.ops.cross_entropy import IGNORE_INDEX
from xtl.ops.selector import hf_impl

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from xtl.model.base import BaseModel


@dataclass
class Capture:
    """What one side computed: rows of ``(T, ...)`` tensors (documents concatenated), loss, gradients."""

    hidden: dict[str, torch.Tensor]
    logits: torch.Tensor | None
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    dtype: torch.dtype


class _Recorder:
    """Forward hooks (removed on exit) that keep each module's output (first element of a tuple) while active."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.modules = modules
        self.outputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
        self.active = False
        self._handles: list[Any] = []

    def __enter__(self) -> _Recorder:
        self._handles = [module.register_forward_hook(self._hook(name)) for name, module in self.modules.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.active:  # recomputation in backward (activation checkpointing) is not recorded
                out = output[0] if isinstance(output, (tuple, list)) else output
                self.outputs[name].append(out.detach().reshape(-1, out.shape[-1]))

        return hook

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def result(self) -> dict[str, torch.Tensor]:
        return {name: torch.cat(parts) for name, parts in self.outputs.items() if parts}


def vision_modules(tower: nn.Module | None) -> dict[str, nn.Module]:
    """The vision rows of a Qwen3-VL vision tower, in this order: ``vision patch_embed``, ``vision block <i>``,
    ``vision merger`` and ``vision deepstack <j>`` (the DeepStack mergers); empty for ``None``.

    xtl's tower (:class:`xtl.module.vision.VisionTower`) keeps transformers' module names, so one function names
    the modules of both sides.
    """
    if tower is None:
        return {}
    return {
        "vision patch_embed": tower.patch_embed,
        **{f"vision block {i}": block for i, block in enumerate(tower.blocks)},
        "vision merger": tower.merger,
        **{f"vision deepstack {j}": merger for j, merger in enumerate(tower.deepstack_merger_list)},
    }


def run_xtl(
    model: BaseModel,
    docs: ParityDocuments,
    mode: str,
    checked: int,
    whole: bool,
    grad_names: list[str],
    forward_context: Callable[[], AbstractContextManager] | None,
    device: torch.device,
) -> Capture:
    """Run ``model`` on ``docs`` as ``mode`` asks; collective: every rank calls it, gradients are gathered.

    Args:
        model: The xtl model (plain or sharded).
        docs: The input.
        mode: ``hf_impl`` (one HF-style call per document under :func:`xtl.ops.hf_impl`) or ``fast`` (packed).
        checked: Decoder layers whose outputs are recorded (the first ones).
        whole: Every layer is checked (the final norm, logits and loss are recorded too).
        grad_names: xtl parameter names whose gradients are kept (empty: no backward).
        forward_context: Entered around each forward.
        device: Where the model's inputs go.
    """
    text, layers = model.text_model(), model.decoder_layers()
    modules = vision_modules(model.vision_tower() if docs.has_images else None)
    modules |= {"embed": text.embed_tokens, **{f"layer {i}": layers[i] for i in range(checked)}}
    if whole:
        modules["norm"] = text.norm
    backward = bool(grad_names) and docs.num_supervised > 0
    run = _xtl_per_document if mode == "hf_impl" else _xtl_packed
    with _Recorder(modules) as recorder, hf_impl(True) if mode == "hf_impl" else nullcontext():
        with torch.set_grad_enabled(backward):
            logits, loss = run(model, docs, recorder, forward_context or nullcontext, backward, device)
    hidden = recorder.result()
    grads = {}
    params = dict(model.named_parameters())
    for name in grad_names if backward else []:  # every rank, same order: sharded gradients are gathered
        grad = params[name].grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()
    if not whole:
        logits = loss = None
    return Capture(hidden, logits, loss, grads, hidden["embed"].dtype)


def _xtl_per_document(
    model: BaseModel,
    docs: ParityDocuments,
    recorder: _Recorder,
    context: Callable[[], AbstractContextManager],
    backward: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's call shapes: one HF-style call per document."""
    logits, loss = [], None
    for i, (ids, labels) in enumerate(zip(docs.input_ids, docs.labels)):
        images = _image_inputs(docs, i, device)
        with context(), recorder.recording():
            out = model(input_ids=ids[None].to(device), labels=_unshift(labels)[None].to(device), **images)
        logits.append(out.logits.detach()[0])
        loss = _add_loss_term(loss, out.loss, labels, docs.num_supervised, backward)
    return torch.cat(logits), loss


def _xtl_packed(
    model: BaseModel,
    docs: ParityDocuments,
    recorder: _Recorder,
    context: Callable[[], AbstractContextManager],
    backward: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As training runs it: the packed micro-batch and the fused chunked loss; logits from a second forward."""
    seq_ctx = SequenceContext.from_lengths(torch.cat(docs.input_ids)[None], docs.lengths).to(device)
    images = [im for im in docs.images if im is not None]
    if images:  # the pack's images in order of appearance, as collate puts them
        seq_ctx.extras = {
            "pixel_values": torch.cat([im.pixel_values for im in images]).to(device),
            "image_grid_thw": torch.cat([im.grid_thw for im in images]).to(device),
        }
    labels = torch.cat(docs.labels)[None].to(device)
    with context(), recorder.recording():
        out = model(seq_ctx=seq_ctx, labels=labels, return_logits=False)
    loss = None
    if docs.num_supervised:
        loss = out.loss_sum / docs.num_supervised
        if backward:
            loss.backward()
        loss = loss.detach()
    with context(), torch.no_grad():
        logits = model(seq_ctx=seq_ctx, return_logits=True).logits.detach()[0]
    return logits, loss


def run_reference(
    reference: PreTrainedModel,
    docs: ParityDocuments,
    checked: int,
    whole: bool,
    grad_names: list[str],
    model: BaseModel,
) -> Capture:
    """Run ``reference`` on ``docs``, one call per document (positions restart at 0).

    Args:
        reference: transformers' eager model.
        docs: The input.
        checked: Decoder layers whose outputs are recorded (the first ones).
        whole: Every layer is checked (the final norm, logits and loss are recorded too).
        grad_names: xtl parameter names whose gradients are mapped back from the reference's (empty: no
            backward).
        model: The xtl model, for its HF key map.
    """
    decoder = reference.get_decoder()
    vision = docs.has_images and model.vision_tower() is not None
    modules = vision_modules(reference.model.visual if vision else None)
    modules |= {"embed": decoder.embed_tokens, **{f"layer {i}": decoder.layers[i] for i in range(checked)}}
    if whole:
        modules["norm"] = decoder.norm
    device = next(reference.parameters()).device
    backward = bool(grad_names) and docs.num_supervised > 0
    loss, logits = None, []
    reference.zero_grad(set_to_none=True)
    with _Recorder(modules) as recorder, torch.set_grad_enabled(backward):
        for i, (ids, labels) in enumerate(zip(docs.input_ids, docs.labels)):
            images = _image_inputs(docs, i, device, reference.config.image_token_id if vision else None)
            with recorder.recording():
                out = reference(
                    input_ids=ids[None].to(device), labels=_unshift(labels)[None].to(device), use_cache=False, **images
                )
            logits.append(out.logits.detach()[0])
            loss = _add_loss_term(loss, out.loss, labels, docs.num_supervised, backward)
    grads = {}
    if backward:
        from transformers.core_model_loading import revert_weight_conversion

        ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        by_key = revert_weight_conversion(reference, ref_grads)  # transformers' module layout -> checkpoint keys
        for name in grad_names:
            keys = model.hf_keys(name)
            if all(k in by_key for k in keys):
                grads[name] = model.hf_to_param(name, [by_key[k] for k in keys])
    reference.zero_grad(set_to_none=True)
    hidden = recorder.result()
    if not whole:
        return Capture(hidden, None, None, grads, hidden["embed"].dtype)
    return Capture(hidden, torch.cat(logits), loss, grads, hidden["embed"].dtype)


def _image_inputs(
    docs: ParityDocuments, index: int, device: torch.device, image_token_id: int | None = None
) -> dict[str, torch.Tensor]:
    """The image arguments of document ``index``'s HF-style call (none for a text-only document); with
    ``image_token_id`` also ``mm_token_type_ids`` (transformers needs it for M-RoPE, xtl derives it)."""
    images = docs.images[index] if docs.images else None
    if images is None:
        return {}
    inputs = {"pixel_values": images.pixel_values.to(device), "image_grid_thw": images.grid_thw.to(device)}
    if image_token_id is not None:
        inputs["mm_token_type_ids"] = (docs.input_ids[index][None] == image_token_id).int().to(device)
    return inputs


def _add_loss_term(
    total: torch.Tensor | None, loss: torch.Tensor, labels: torch.Tensor, supervised: int, backward: bool
) -> torch.Tensor | None:
    """Add one document's mean loss weighted by its share of the supervised tokens (and backpropagate it)."""
    count = int((labels != IGNORE_INDEX).sum())
    if not count:
        return total
    term = loss * (count / supervised)
    if backward:
        term.backward()
    term = term.detach()
    return term if total is None else total + term


def _unshift(labels: torch.Tensor) -> torch.Tensor:
    """HF-style labels whose shift (``labels[t+1]`` as target of ``t``) gives ``labels`` (last target unseen)."""
    return torch.cat([labels.new_full((1,), IGNORE_INDEX), labels[:-1]])


def compare_captures(xtl: Capture, ref: Capture, bounds: ParityTolerance) -> list[ParityRow]:
    """The rows of the report, in model order: hidden states, logits, loss, then gradients."""
    rows = [_row(name, "hidden", xtl.hidden.get(name), tensor, bounds) for name, tensor in ref.hidden.items()]
    if ref.logits is not None and xtl.logits is not None:
        rows.append(_row("logits", "logits", xtl.logits, ref.logits, bounds))
    if ref.loss is not None and xtl.loss is not None:
        rows.append(_row("loss", "loss", xtl.loss, ref.loss, bounds))
    for name, grad in xtl.grads.items():
        rows.append(_row(f"grad {name}", "grad", grad, ref.grads.get(name), bounds))
    return rows


def _row(name: str, kind: str, x: torch.Tensor | None, ref: torch.Tensor | None, bounds: ParityTolerance) -> ParityRow:
    bound = bounds.bound(kind)
    if x is None or ref is None or x.shape != ref.shape:
        return ParityRow(name, kind, math.inf, math.inf, bound, exact=False)  # missing or misshapen: fails
    x, ref = x.detach(), ref.detach().to(x.device)
    exact = torch.equal(x, ref.to(x.dtype)) if x.dtype == ref.dtype else False
    diff = x.double() - ref.double()
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    if kind == "loss":
        error = max_abs
    else:
        norm = float(torch.linalg.vector_norm(ref.double()))
        error = float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return ParityRow(name, kind, max_abs, error, bound, exact=exact or (max_abs == 0 and not math.isnan(error)))
