"""The entry point of a parity check: :func:`run_parity_check` and the default gradients it compares."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.model.parity.compare import compare_captures, run_reference, run_xtl
from xtl.model.parity.documents import ParityDocuments
from xtl.model.parity.presets import resolve_tolerance
from xtl.model.parity.reference import build_reference, is_main
from xtl.model.parity.report import ParityReport, ParityRow

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from xtl.model.base import BaseModel


def default_grad_params(model: BaseModel) -> list[str]:
    """The gradients checked by default: the parameters of the first and the last decoder layer, of the final norm
    and of the head, by name, in that order; of a vision-language model first those of the first vision block
    (its gradient flows back through every later block and merger) and of the patch merger.

    The parts come from the model's typed accessors (``vision_tower()``, ``decoder_layers()``, ``text_model()``);
    with tied embeddings the head's weight is the embedding's, named ``embed_tokens.weight``.
    """
    text, layers = model.text_model(), model.decoder_layers()
    name_of = {id(param): name for name, param in model.named_parameters()}
    names: list[str] = []
    tower = model.vision_tower()
    vision = [] if tower is None else [tower.blocks[0], tower.merger]
    for part in (*vision, layers[0], layers[-1], text.norm, text.lm_head):
        names += [name_of[id(p)] for p in part.parameters() if name_of[id(p)] not in names]
    return names


def run_parity_check(
    model: BaseModel,
    documents: ParityDocuments,
    *,
    hf_config: PretrainedConfig | None = None,
    reference: PreTrainedModel | None = None,
    mode: str = "hf_impl",
    tolerance: str = "auto",
    tolerances: Mapping[str, float] | None = None,
    grad_params: Sequence[str] | None = None,
    max_layers: int | None = None,
    dtype: torch.dtype | None = None,
    forward_context: Callable[[], AbstractContextManager] | None = None,
) -> ParityReport | None:
    """Compare ``model`` with transformers on ``documents``; see :mod:`xtl.model.parity`.

    The model's weights, gradients, train/eval flags and the RNG state are unchanged afterwards.

    Args:
        model: The xtl model (plain or sharded; every rank calls with the same documents).
        documents: The input.
        hf_config: Config of the reference built from ``model``'s weights (when ``reference`` is not given).
        reference: A ready reference (e.g. loaded from an HF directory), for a single-process check.
        mode: ``hf_impl`` (bitwise, transformers' ops and call shapes) or ``fast`` (the run's own ops, packed).
        tolerance: ``auto`` or a key of :data:`TOLERANCES`.
        tolerances: Bounds overriding the preset's (``hidden``, ``logits``, ``loss``, ``grad``).
        grad_params: Glob patterns of xtl parameter names whose gradients are compared (default
            :func:`default_grad_params`; empty: no backward).
        max_layers: Compare only the first decoder layers (a built reference then has only those; logits, loss
            and gradients are compared only when every layer is).
        dtype: Reference dtype (default: the dtype of xtl's embedding output, i.e. its compute dtype).
        forward_context: Entered around the xtl forwards (e.g. the trainer's autocast).

    Returns:
        The report on rank 0, ``None`` on the other ranks.

    Raises:
        ValueError: Bad mode, tolerance or a ``grad_params`` pattern that matches no trainable parameter.
    """
    resolve_tolerance(tolerance, mode, torch.float32, tolerances)  # bad options fail on every rank, before any work
    if reference is None and hf_config is None:
        raise ValueError("pass the reference or the hf_config to build it from")
    vision = model.vision_tower() is not None
    if model.text_model() is not model and not vision:
        raise ValueError(
            f"{type(model).__name__} is neither a decoder-only text model nor a vision-language model: the parity "
            "check covers those"
        )
    main = is_main()
    num_layers = len(model.decoder_layers())
    checked = num_layers if max_layers is None else max(0, min(max_layers, num_layers))
    if reference is not None:
        checked = min(checked, len(reference.get_decoder().layers))
    whole = checked == num_layers
    if grad_params is None:
        grad_names = _select_grads(model, default_grad_params(model), strict=False)
    else:
        grad_names = _select_grads(model, grad_params, strict=True)
    notes = []
    if vision and not documents.has_images:
        documents = documents.with_probe_image(model.config)
        notes.append("no image in the documents: a probe document with one random image was added")
    supervised = documents.num_supervised
    if not whole:
        notes.append(f"only the first {checked} of {num_layers} layers: logits, loss and gradients not compared")
        grad_names = []
    if supervised == 0:
        notes.append("no supervised token: loss and gradients not compared")
    device = _device_of(model)
    with _isolated(model, device):
        xtl_out = run_xtl(model, documents, mode, checked, whole, grad_names, forward_context, device)
        load_errors: list[str] = []
        if reference is None:
            reference, load_errors = build_reference(
                model, hf_config, dtype or xtl_out.dtype, device, None if whole else checked
            )
        if not main:
            return None
        compute_dtype = next(reference.parameters()).dtype if reference is not None else (dtype or xtl_out.dtype)
        name, bounds = resolve_tolerance(tolerance, mode, compute_dtype, tolerances)
        rows: list[ParityRow] = []
        if reference is not None and not load_errors:
            ref_out = run_reference(reference, documents, checked, whole, grad_names, model)
            rows = compare_captures(xtl_out, ref_out, bounds)
    return ParityReport(
        rows=rows,
        mode=mode,
        dtype=str(compute_dtype).removeprefix("torch."),
        tolerance_name=name,
        tolerance=bounds,
        lengths=documents.lengths,
        num_images=documents.num_images,
        num_layers=num_layers,
        checked_layers=checked,
        load_errors=load_errors,
        notes=notes,
    )


def _select_grads(model: BaseModel, patterns: Sequence[str], strict: bool) -> list[str]:
    """Trainable parameter names matching ``patterns`` (model order); with ``strict`` each pattern must match."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for pattern in patterns if strict else ():
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ValueError(f"grad_params: {pattern!r} matches no trainable parameter (e.g. {names[:3]})")
    return [name for name in names if any(fnmatchcase(name, p) for p in patterns)]


@contextmanager
def _isolated(model: BaseModel, device: torch.device) -> Iterator[None]:
    """Leave gradients, train/eval flags and RNG states as they were; dropout off inside."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modes = [(module, module.training) for module in model.modules()]
    for p in params:
        p.grad = None
    model.eval()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        for module, training in modes:
            module.training = training


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters())
    return param.to_local().device if isinstance(param, DTensor) else param.device
