"""The result of a parity check: :class:`ParityRow`, :class:`ParityReport` (table, failure message, metrics, JSON)
and :class:`ParityCheckError`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from xtl.model.parity.presets import ParityTolerance


@dataclass
class ParityRow:
    """One compared quantity.

    Attributes:
        name: ``vision patch_embed``, ``vision block <i>``, ``vision merger``, ``vision deepstack <j>`` (a
            vision-language model's tower), ``embed``, ``layer <i>``, ``norm``, ``logits``, ``loss`` or
            ``grad <xtl parameter name>``.
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
        rows: Compared quantities in model order (see :mod:`xtl.model.parity`).
        mode: ``hf_impl`` or ``fast``.
        dtype: Compute dtype of the comparison (``float32``, ``bfloat16``).
        tolerance_name: The preset checked against.
        tolerance: Its bounds.
        lengths: Tokens per document.
        num_images: Images in the documents (vision-language models; their vision rows come first).
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
    num_images: int = 0
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
            f"{len(self.lengths)} documents, {sum(self.lengths)} tokens"
            f"{f', {self.num_images} images' if self.num_images else ''}; {layers}"
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
            "images": self.num_images,
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


class ParityCheckError(RuntimeError):
    """A parity check exceeded its tolerance; ``report`` holds the rows (``None`` on ranks other than 0)."""

    def __init__(self, message: str, report: ParityReport | None = None) -> None:
        super().__init__(message)
        self.report = report


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
