"""Runtime parity with transformers: run an xtl model and transformers' eager model on the same tokens, compare.

The engine behind the ``HFParityCheck`` callback and ``xtl check-parity`` (it imports no Lightning). The reference
is transformers' own model class for the config (eager attention, eager experts), loaded through transformers'
own loader (``from_pretrained``) from an HF directory or from the xtl model's current weights mapped through its
HF key map. Both models run on the same documents, each document on its own for the reference (positions
restart at 0), and the report compares, row by row:

- ``embed``, ``layer 0`` ... ``layer L-1``, ``norm``: hidden states after the embedding, every decoder layer and
  the final norm (forward hooks);
- ``logits`` and ``loss`` (the cross-entropy over the supervised tokens of all documents);
- ``grad <name>``: gradients of the loss for a set of xtl parameters (default: first and last decoder layer,
  final norm, head).

A row's error is the relative L2 error ``||x - ref|| / ||ref||`` (the absolute difference for the loss); it
passes when the tensors are equal or the error is within the bound of the tolerance preset (a bound of 0 asks
for bitwise equality). The first failing row, in the order above, is the first diverging layer.

Two modes:

- ``hf_impl``: the xtl model runs under :func:`xtl.ops.hf_impl` (every op selector returns transformers' exact
  op) with the same call shapes as the reference (one HF-style call per document), so the bound is 0.
- ``fast``: the xtl model runs as training runs it (the run's own ops, the packed micro-batch, the fused chunked
  loss), compared with the bounds of the compute dtype.

Every rank of a distributed run calls :func:`run_parity_check` with the same documents (sharded parameters and
gradients are gathered one tensor at a time); only rank 0 builds and runs the reference and gets the report.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.batch import SequenceContext
from xtl.ops.cross_entropy import IGNORE_INDEX
from xtl.ops.selector import hf_impl

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from xtl.model.base import BaseModel

__all__ = [
    "PARITY_MODES",
    "TOLERANCES",
    "ParityCheckError",
    "ParityDocuments",
    "ParityReport",
    "ParityRow",
    "ParityTolerance",
    "build_reference",
    "default_grad_params",
    "load_reference",
    "resolve_tolerance",
    "run_parity_check",
]

PARITY_MODES = ("hf_impl", "fast")


@dataclass(frozen=True)
class ParityTolerance:
    """Bounds of one check; a row passes when its tensors are equal or its error is within its bound.

    Attributes:
        hidden: Relative L2 error of the hidden states after the embedding, each decoder layer and the final norm.
        logits: Relative L2 error of the logits.
        loss: Absolute difference of the loss.
        grad: Relative L2 error of each checked gradient.
    """

    hidden: float
    logits: float
    loss: float
    grad: float

    def bound(self, kind: str) -> float:
        """The bound of a row kind (``hidden``, ``logits``, ``loss`` or ``grad``)."""
        return getattr(self, kind)


# Set from measurements on tiny random models of every family (docs/models.md, "Runtime parity check"): bf16 and
# fp8 gradient bounds are wide because a routing flip near a top-k tie moves MoE router and expert gradients by
# 10-60%; a bound below 1 still catches a dropped gradient (error 1) or a sign error (error 2).
TOLERANCES: dict[str, ParityTolerance] = {
    "bitwise": ParityTolerance(hidden=0.0, logits=0.0, loss=0.0, grad=0.0),
    # FSDP with a 16-bit param_dtype: the forward is transformers' to the bit, but each document's gradient is
    # reduced in reduce_dtype (fp32) and summed there, where transformers' 16-bit model sums them in 16 bits
    # (measured: 2-3e-3 relative, one bf16 rounding)
    "bitwise_forward": ParityTolerance(hidden=0.0, logits=0.0, loss=0.0, grad=1e-2),
    "fp32": ParityTolerance(hidden=1e-5, logits=1e-5, loss=1e-5, grad=1e-4),
    "bf16": ParityTolerance(hidden=5e-2, logits=5e-2, loss=5e-3, grad=0.3),
    "fp8": ParityTolerance(hidden=0.25, logits=0.25, loss=0.1, grad=0.75),
}


class ParityCheckError(RuntimeError):
    """A parity check exceeded its tolerance; ``report`` holds the rows (``None`` on ranks other than 0)."""

    def __init__(self, message: str, report: ParityReport | None = None) -> None:
        super().__init__(message)
        self.report = report


def resolve_tolerance(
    name: str, mode: str, dtype: torch.dtype, overrides: Mapping[str, float] | None = None
) -> tuple[str, ParityTolerance]:
    """The tolerance preset to check with, and its bounds with ``overrides`` applied.

    Args:
        name: ``auto`` or a key of :data:`TOLERANCES`. ``auto`` is ``bitwise`` in ``hf_impl`` mode, else ``bf16``
            for a 16-bit compute dtype and ``fp32`` otherwise.
        mode: ``hf_impl`` or ``fast``.
        dtype: The compute dtype of the comparison.
        overrides: Bounds replacing the preset's (keys ``hidden``, ``logits``, ``loss``, ``grad``).

    Raises:
        ValueError: Unknown preset, mode or override key, or a negative bound.
    """
    if mode not in PARITY_MODES:
        raise ValueError(f"mode must be one of {PARITY_MODES}, got {mode!r}")
    if name == "auto":
        name = "bitwise" if mode == "hf_impl" else ("bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32")
    if name not in TOLERANCES:
        raise ValueError(f"tolerance must be 'auto' or one of {sorted(TOLERANCES)}, got {name!r}")
    bounds = asdict(TOLERANCES[name])
    for key, value in (overrides or {}).items():
        if key not in bounds:
            raise ValueError(f"tolerances: unknown key {key!r}; use {sorted(bounds)}")
        if not float(value) >= 0:
            raise ValueError(f"tolerances.{key} must be >= 0, got {value!r}")
        bounds[key] = float(value)
    return (name if not overrides else f"{name}+overrides"), ParityTolerance(**bounds)


@dataclass
class ParityDocuments:
    """The documents one check runs on.

    Attributes:
        input_ids: One 1-D int64 tensor per document.
        labels: Each document's shifted targets (``labels[t]`` is the target of position ``t``; -100: no loss).
    """

    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("a parity check needs at least one document")
        if [t.numel() for t in self.input_ids] != [t.numel() for t in self.labels]:
            raise ValueError("every document needs one label per token")

    @classmethod
    def from_packed(
        cls, seq_ctx: SequenceContext, labels: torch.Tensor, max_tokens: int | None = None
    ) -> ParityDocuments:
        """The documents of a packed micro-batch: trailing padding dropped, cut after ``max_tokens`` tokens.

        Args:
            seq_ctx: The packed batch (``input_ids`` ``(1, T)``, ``cu_seq_lens``, ``num_padding``).
            labels: Its shifted labels ``(1, T)``.
            max_tokens: Keep at most this many tokens (a cut document loses its last target).
        """
        if seq_ctx.input_ids is None:
            raise ValueError("a parity check needs token ids, not inputs_embeds")
        ids, targets = seq_ctx.input_ids.reshape(-1).cpu(), labels.reshape(-1).cpu()
        bounds = seq_ctx.cu_seq_lens.tolist()
        limit = bounds[-1] - seq_ctx.num_padding
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        docs, doc_labels = [], []
        for start, end in zip(bounds[:-1], bounds[1:]):
            end = min(end, limit)
            if end <= start:
                break
            docs.append(ids[start:end].clone())
            doc_labels.append(targets[start:end].clone())
            doc_labels[-1][-1] = IGNORE_INDEX  # the target after a document's (or the cut's) last token is unseen
        return cls(docs, doc_labels)

    @classmethod
    def from_token_lists(cls, documents: Sequence[Sequence[int]], max_tokens: int | None = None) -> ParityDocuments:
        """Documents of token ids, every next token supervised, cut after ``max_tokens`` tokens in all."""
        ids: list[torch.Tensor] = []
        left = math.inf if max_tokens is None else max_tokens
        for doc in documents:
            doc = list(doc)[: int(min(left, len(doc)))]
            if doc:
                ids.append(torch.tensor(doc, dtype=torch.long))
                left -= len(doc)
            if left <= 0:
                break
        return cls(ids, [_next_token_labels(t) for t in ids])

    @classmethod
    def random(cls, vocab_size: int, num_tokens: int, num_documents: int = 2, seed: int = 0) -> ParityDocuments:
        """``num_documents`` documents of uniformly random token ids, ``num_tokens`` in all."""
        if num_tokens < num_documents or num_documents < 1:
            raise ValueError(f"cannot split {num_tokens} tokens into {num_documents} documents")
        generator = torch.Generator().manual_seed(seed)
        sizes = [num_tokens // num_documents + (i < num_tokens % num_documents) for i in range(num_documents)]
        ids = [torch.randint(0, vocab_size, (n,), generator=generator) for n in sizes]
        return cls(ids, [_next_token_labels(t) for t in ids])

    @property
    def lengths(self) -> list[int]:
        """Tokens per document."""
        return [t.numel() for t in self.input_ids]

    @property
    def num_tokens(self) -> int:
        """Tokens in all documents."""
        return sum(self.lengths)

    @property
    def num_supervised(self) -> int:
        """Supervised targets in all documents."""
        return sum(int((t != IGNORE_INDEX).sum()) for t in self.labels)

    def max_token_id(self) -> int:
        """The largest token id (to check it against a vocabulary)."""
        return max(int(t.max()) for t in self.input_ids)


@dataclass
class ParityRow:
    """One compared quantity.

    Attributes:
        name: ``embed``, ``layer <i>``, ``norm``, ``logits``, ``loss`` or ``grad <xtl parameter name>``.
        kind: ``hidden``, ``logits``, ``loss`` or ``grad`` (selects the bound).
        max_abs: Largest absolute difference.
        error: Relative L2 error (absolute difference for the loss).
        bound: The tolerance bound of the row.
        exact: The tensors are equal.
    """

    name: str
    kind: str
    max_abs: float
    error: float
    bound: float
    exact: bool

    @property
    def ok(self) -> bool:
        """Equal, or within a non-zero bound (a NaN error fails)."""
        return self.exact or (self.bound > 0 and self.error <= self.bound)


@dataclass
class ParityReport:
    """The result of one check (rank 0 only).

    Attributes:
        rows: Compared quantities in model order (see the module docstring).
        mode: ``hf_impl`` or ``fast``.
        dtype: Compute dtype of the comparison (``float32``, ``bfloat16``).
        tolerance_name: The preset checked against.
        tolerance: Its bounds.
        lengths: Tokens per document.
        num_layers: Decoder layers of the xtl model.
        checked_layers: Decoder layers compared (the first ones; logits, loss and gradients need them all).
        load_errors: Problems filling the reference with the xtl weights (missing, unexpected or misshapen keys).
        step: The training step of the check (``None`` outside training).
        notes: What was skipped and why.
    """

    rows: list[ParityRow]
    mode: str
    dtype: str
    tolerance_name: str
    tolerance: ParityTolerance
    lengths: list[int]
    num_layers: int
    checked_layers: int
    load_errors: list[str] = field(default_factory=list)
    step: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every row passed and the reference loaded cleanly."""
        return not self.load_errors and all(row.ok for row in self.rows)

    @property
    def first_divergence(self) -> str | None:
        """The first failing row's name (``weights`` when the reference could not be filled), or ``None``."""
        if self.load_errors:
            return "weights"
        return next((row.name for row in self.rows if not row.ok), None)

    def metrics(self) -> dict[str, float]:
        """``parity/max_abs_logits``, ``parity/max_rel_grad``, ``parity/loss_abs_diff`` (those compared) and
        ``parity/ok``."""
        out: dict[str, float] = {}
        by_kind: dict[str, list[ParityRow]] = {}
        for row in self.rows:
            by_kind.setdefault(row.kind, []).append(row)
        if "logits" in by_kind:
            out["parity/max_abs_logits"] = by_kind["logits"][0].max_abs
        if "grad" in by_kind:
            out["parity/max_rel_grad"] = max(row.error for row in by_kind["grad"])
        if "loss" in by_kind:
            out["parity/loss_abs_diff"] = by_kind["loss"][0].max_abs
        out["parity/ok"] = float(self.ok)
        return out

    def failure_message(self) -> str:
        """One paragraph naming the first diverging layer (empty when the check passed)."""
        if self.ok:
            return ""
        where = "" if self.step is None else f" at step {self.step}"
        context = f"mode {self.mode}, {self.dtype}, tolerance {self.tolerance_name}"
        if self.load_errors:
            return (
                f"HF parity check failed{where}: the reference could not be filled from the xtl weights through "
                f"the HF key map ({context}): " + "; ".join(self.load_errors)
            )
        row = next(r for r in self.rows if not r.ok)
        measure = "absolute difference" if row.kind == "loss" else "relative error"
        return (
            f"HF parity check failed{where}: first diverging layer: {row.name} ({measure} {_fmt(row.error)} > "
            f"{_fmt(row.bound)}, max abs diff {_fmt(row.max_abs)}; {context})"
        )

    def render(self) -> str:
        """The per-layer table, a header line and a verdict line."""
        layers = f"{self.checked_layers}/{self.num_layers} layers"
        header = (
            f"HF parity: mode {self.mode}, {self.dtype}, tolerance {self.tolerance_name}; "
            f"{len(self.lengths)} documents, {sum(self.lengths)} tokens; {layers}"
        )
        width = max([len(r.name) for r in self.rows] + [8])
        lines = [header, f"{'row':<{width}}  {'max_abs':>10}  {'error':>10}  {'bound':>10}"]
        for row in self.rows:
            status = "equal" if row.exact else ("ok" if row.ok else "FAIL")
            lines.append(
                f"{row.name:<{width}}  {_fmt(row.max_abs):>10}  {_fmt(row.error):>10}  {_fmt(row.bound):>10}  {status}"
            )
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"load error: {error}" for error in self.load_errors]
        lines.append("PASSED" if self.ok else f"FAILED: first diverging layer: {self.first_divergence}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (non-finite numbers as strings)."""
        return {
            "ok": self.ok,
            "step": self.step,
            "mode": self.mode,
            "dtype": self.dtype,
            "tolerance": {"name": self.tolerance_name, **asdict(self.tolerance)},
            "documents": len(self.lengths),
            "tokens": sum(self.lengths),
            "lengths": self.lengths,
            "layers": {"checked": self.checked_layers, "total": self.num_layers},
            "first_divergence": self.first_divergence,
            "load_errors": self.load_errors,
            "notes": self.notes,
            "rows": [{**asdict(row), "ok": row.ok} for row in self.rows],
            "metrics": self.metrics(),
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(_json_safe(self.to_dict()), indent=2)


def default_grad_params(model: BaseModel) -> list[str]:
    """The gradients checked by default: first and last decoder layer, final norm, and the head.

    With tied embeddings the head is ``embed_tokens.weight``.
    """
    last = len(model.layers) - 1
    head = "embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    return ["layers.0.*", f"layers.{last}.*", "norm.weight", head]


def load_reference(
    source: str | Path | Mapping[str, torch.Tensor],
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[PreTrainedModel | None, list[str]]:
    """transformers' eager model for ``hf_config`` (eager attention and experts), loaded by transformers itself.

    Args:
        source: An HF model directory, or HF-keyed tensors (checkpoint layout).
        hf_config: The config (its ``num_hidden_layers`` may be smaller than the checkpoint's).
        dtype: Parameter dtype (transformers keeps its fp32-by-design tensors in fp32).
        device: Where the model runs.

    Returns:
        The model in eval mode (``None`` if it could not be loaded) and the loading problems (missing, unexpected
        and misshapen keys), empty when every weight matched.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"transformers has no causal-LM class for {type(hf_config).__name__}: no reference")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    config = copy.deepcopy(hf_config)
    is_path = isinstance(source, (str, Path))
    kwargs = {"state_dict": dict(source)} if not is_path else {}
    try:
        with _quiet_transformers():
            model, info = model_class.from_pretrained(
                str(source) if is_path else None,
                config=config,
                attn_implementation="eager",
                experts_implementation="eager",
                dtype=dtype,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below as load errors
                **kwargs,
            )
    except (RuntimeError, ValueError, KeyError) as err:  # e.g. a size mismatch
        return None, [f"{type(err).__name__}: {err}".splitlines()[0]]
    errors = []
    unexpected = sorted(info.get("unexpected_keys", ()))
    if is_path:  # a checkpoint may hold more layers than asked for, or extra modules (e.g. MTP)
        unexpected = []
    for what, keys in (
        ("missing keys", sorted(info.get("missing_keys", ()))),
        ("unexpected keys", unexpected),
        ("size mismatches", sorted(_mismatch(k) for k in info.get("mismatched_keys", ()))),
    ):
        if keys:
            errors.append(f"{what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")
    return model.to(device).eval(), errors


def build_reference(
    model: BaseModel,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_layers: int | None = None,
) -> tuple[PreTrainedModel | None, list[str]]:
    """The reference filled with ``model``'s current weights through its HF key map.

    Collective under torch.distributed: every rank gathers each sharded tensor in turn (one full tensor at a
    time); rank 0 keeps the HF-keyed tensors (on CPU) and builds the reference, the others return ``(None, [])``.

    Args:
        model: The xtl model (plain or FSDP2/DTensor-sharded).
        hf_config: transformers config of the model.
        dtype: Reference parameter dtype.
        device: Where the reference runs.
        max_layers: Build only the first decoder layers.
    """
    main = _is_main()
    keep_layers = len(model.layers) if max_layers is None else min(max_layers, len(model.layers))
    keep_fp32 = model._keep_fp32_names()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.checkpoint_tensors().items():
        layer = _layer_index(name)
        if layer is not None and layer >= keep_layers:
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if not main:
            continue
        if full.is_floating_point() and name not in keep_fp32:
            full = full.to(dtype)
        for key, part in zip(model.hf_keys(name), model.param_to_hf(name, full)):
            state[key] = part.to("cpu", copy=True)
    if not main:
        return None, []
    return load_reference(state, truncated_hf_config(hf_config, keep_layers), dtype, device)


def truncated_hf_config(hf_config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """A copy of ``hf_config`` with only its first ``num_layers`` decoder layers (per-layer lists cut too)."""
    config = copy.deepcopy(hf_config)
    if num_layers < config.num_hidden_layers:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types[:num_layers])
    return config


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
    """Compare ``model`` with transformers on ``documents``; see the module docstring.

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
    missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(model, name)]
    if missing:
        raise ValueError(
            f"{type(model).__name__} has no {missing[0]}: the parity check covers decoder-only text models"
        )
    main = _is_main()
    num_layers = len(model.layers)
    checked = num_layers if max_layers is None else max(0, min(max_layers, num_layers))
    if reference is not None:
        checked = min(checked, len(reference.model.layers))
    whole = checked == num_layers
    if grad_params is None:
        grad_names = _select_grads(model, default_grad_params(model), strict=False)
    else:
        grad_names = _select_grads(model, grad_params, strict=True)
    supervised = documents.num_supervised
    notes = []
    if not whole:
        notes.append(f"only the first {checked} of {num_layers} layers: logits, loss and gradients not compared")
        grad_names = []
    if supervised == 0:
        notes.append("no supervised token: loss and gradients not compared")
    device = _device_of(model)
    with _isolated(model, device):
        xtl_out = _run_xtl(model, documents, mode, checked, whole, grad_names, forward_context, device)
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
            ref_out = _run_reference(reference, documents, checked, whole, grad_names, model)
            rows = _compare(xtl_out, ref_out, bounds)
    return ParityReport(
        rows=rows,
        mode=mode,
        dtype=str(compute_dtype).removeprefix("torch."),
        tolerance_name=name,
        tolerance=bounds,
        lengths=documents.lengths,
        num_layers=num_layers,
        checked_layers=checked,
        load_errors=load_errors,
        notes=notes,
    )


# ---- private ---------------------------------------------------------------------------------------------------


@dataclass
class _Capture:
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


def _run_xtl(
    model: BaseModel,
    docs: ParityDocuments,
    mode: str,
    checked: int,
    whole: bool,
    grad_names: list[str],
    forward_context: Callable[[], AbstractContextManager] | None,
    device: torch.device,
) -> _Capture:
    modules = {"embed": model.embed_tokens, **{f"layer {i}": model.layers[i] for i in range(checked)}}
    if whole:
        modules["norm"] = model.norm
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
    return _Capture(hidden, logits, loss, grads, hidden["embed"].dtype)


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
    for ids, labels in zip(docs.input_ids, docs.labels):
        with context(), recorder.recording():
            out = model(input_ids=ids[None].to(device), labels=_unshift(labels)[None].to(device))
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


def _run_reference(
    reference: PreTrainedModel,
    docs: ParityDocuments,
    checked: int,
    whole: bool,
    grad_names: list[str],
    model: BaseModel,
) -> _Capture:
    decoder = reference.model
    modules = {"embed": decoder.embed_tokens, **{f"layer {i}": decoder.layers[i] for i in range(checked)}}
    if whole:
        modules["norm"] = decoder.norm
    device = next(reference.parameters()).device
    backward = bool(grad_names) and docs.num_supervised > 0
    loss, logits = None, []
    reference.zero_grad(set_to_none=True)
    with _Recorder(modules) as recorder, torch.set_grad_enabled(backward):
        for ids, labels in zip(docs.input_ids, docs.labels):
            with recorder.recording():
                out = reference(
                    input_ids=ids[None].to(device), labels=_unshift(labels)[None].to(device), use_cache=False
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
        return _Capture(hidden, None, None, grads, hidden["embed"].dtype)
    return _Capture(hidden, torch.cat(logits), loss, grads, hidden["embed"].dtype)


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


def _compare(xtl: _Capture, ref: _Capture, bounds: ParityTolerance) -> list[ParityRow]:
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


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:-1] = ids[1:]
    return labels


def _unshift(labels: torch.Tensor) -> torch.Tensor:
    """HF-style labels whose shift (``labels[t+1]`` as target of ``t``) gives ``labels`` (last target unseen)."""
    return torch.cat([labels.new_full((1,), IGNORE_INDEX), labels[:-1]])


def _layer_index(name: str) -> int | None:
    match = re.match(r"layers\.(\d+)\.", name)
    return int(match[1]) if match else None


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters())
    return param.to_local().device if isinstance(param, DTensor) else param.device


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _mismatch(entry: Any) -> str:
    """``key (given [a, b], expected [c, d])`` from transformers' ``(key, given shape, expected shape)``."""
    if isinstance(entry, tuple) and len(entry) == 3:
        return f"{entry[0]} (given {list(entry[1])}, expected {list(entry[2])})"
    return str(entry)


def _fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.3e}"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
