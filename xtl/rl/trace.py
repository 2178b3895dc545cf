"""Rollout traces: timed spans of a run's stages (agent loop, generation, tools, judging, filtering, training), each
naming the samples it covers, written as JSON lines and optionally exported through OpenTelemetry (OTLP).

A :class:`Tracer` records spans; :func:`current` is the process's active one (:data:`NULL_TRACER`, which records
nothing, until :func:`activate` sets one)::

    tracer = Tracer("runs/x/traces.jsonl")
    activate(tracer)
    with current().span("generate", stage="generate", samples=ids, step=3) as span:
        ...
        span.set(finish_reason="length")
    tracer.close()

Spans nest per thread (and per asyncio task): a span opened inside another has it as parent, and its ``chain`` is
the names of the enclosing spans and its own (``"agent_loop -> generate"``). Another thread or process continues a
sample's chain from :func:`carrier`, passed as ``parent=`` to :meth:`Tracer.span`.

Spans carry no text: attributes are scalars, strings are cut to 200 characters, and keys that would hold a prompt,
a response or a secret are refused. Ids come from ``os.urandom`` (the random state of the run is not touched).
``python -m xtl.rl.trace_viewer traces.jsonl`` turns the file into one HTML page (:mod:`xtl.rl.trace_viewer`).
"""

from __future__ import annotations

import contextvars
import json
import math
import operator
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["NULL_TRACER", "Span", "Tracer", "activate", "carrier", "current"]

MAX_STRING = 200
"""Longest string attribute kept (longer ones are cut)."""

_REFUSED_KEYS = frozenset(
    {"prompt", "prompts", "response", "responses", "messages", "text", "content", "api_key", "secret", "token",
     "tokens", "password"}
)  # fmt: skip
_REFUSED_SUFFIXES = ("_api_key", "_secret", "_password")

# the innermost open span of this thread / asyncio task: (trace id, span id, chain)
_OPEN: contextvars.ContextVar[tuple[str, str, str] | None] = contextvars.ContextVar("xtl_trace_open", default=None)


def _new_id(num_bytes: int) -> str:
    """A random nonzero hex id (OpenTelemetry's sizes: 16 bytes for a trace, 8 for a span)."""
    while True:
        value = os.urandom(num_bytes).hex()
        if int(value, 16):
            return value


def _check_attributes(attributes: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """Validated copies of span attributes.

    Args:
        attributes: Keyword attributes of a span.

    Returns:
        The attributes with builtin scalar values, strings cut to :data:`MAX_STRING` characters, non-finite floats as
        the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such numbers).

    Raises:
        ValueError: A key that would hold a prompt, a response or a secret (also as ``key.<sample id>``).
        TypeError: A value that is not a str, int, float or bool.
    """
    checked: dict[str, str | int | float | bool] = {}
    for key, value in attributes.items():
        lowered = key.lower()
        base = lowered.split(".", 1)[0]
        if base in _REFUSED_KEYS or base.endswith(_REFUSED_SUFFIXES):
            raise ValueError(f"trace attribute {key!r} is refused: spans carry no prompts, responses or secrets")
        if isinstance(value, bool):
            checked[key] = bool(value)
        elif isinstance(value, int):
            checked[key] = int(value)
        elif isinstance(value, float):
            checked[key] = float(value) if math.isfinite(value) else str(float(value))
        elif isinstance(value, str):
            checked[key] = str(value)[:MAX_STRING]
        else:
            raise TypeError(
                f"trace attribute {key!r} must be a str, int, float or bool scalar, got {type(value).__name__}"
            )
    return checked


class Span:
    """One timed span: a context manager (``with tracer.span(...) as span``) that records itself on exit.

    Attributes:
        name: What ran (``"generate"``, ``"calculator"``).
        stage: The stage it belongs to (``"agent_loop"``, ``"generate"``, ``"tool"``, ``"judge"``, ``"filter"``,
            ``"train"``).
        samples: Ids of the samples it covers (a batched engine call covers many).
        step: The training step, if known.
        trace_id: The trace (one per run; the parent's when continued from a carrier).
        span_id: This span's id.
        parent_id: The enclosing span's id (``None`` for a root span).
        chain: The names of the enclosing spans and this one, outermost first, joined by ``" -> "``.
        attributes: Scalar attributes (``status``, ``reward``, ``filter_reason``, ``finish_reason`` are read by the
            viewer, also per sample as ``status.<sample id>``).
    """

    __slots__ = (
        "_perf_start",
        "_token",
        "_tracer",
        "attributes",
        "chain",
        "name",
        "parent_id",
        "samples",
        "span_id",
        "stage",
        "start_ns",
        "step",
        "trace_id",
    )

    def __init__(
        self,
        tracer: Tracer | None,
        name: str,
        stage: str,
        samples: tuple[str, ...],
        step: int | None,
        attributes: dict[str, str | int | float | bool],
        parent: tuple[str, str, str] | None,
    ) -> None:
        """Prepares a span (timed from ``__enter__``).

        Args:
            tracer: The tracer that records it (``None``: a span that does nothing).
            name: What ran.
            stage: The stage it belongs to.
            samples: Ids of the samples it covers.
            step: The training step.
            attributes: Validated attributes.
            parent: ``(trace id, span id, chain)`` of the parent span, or ``None`` for a root span.
        """
        self._tracer = tracer
        self.name = name
        self.stage = stage
        self.samples = samples
        self.step = step
        self.attributes = attributes
        if parent is None:
            self.trace_id = tracer.trace_id if tracer is not None else ""
            self.parent_id: str | None = None
            self.chain = name
        else:
            self.trace_id, parent_id, parent_chain = parent
            self.parent_id = parent_id or None
            self.chain = f"{parent_chain} -> {name}" if parent_chain else name
        self.span_id = _new_id(8) if tracer is not None else ""
        self.start_ns = 0
        self._perf_start = 0
        self._token: contextvars.Token | None = None

    def set(self, **attributes: Any) -> None:
        """Adds or replaces attributes (``span.set(reward=1.0, status="filtered")``).

        Args:
            **attributes: str, int, float or bool values (the checks of :meth:`Tracer.span`).

        Raises:
            ValueError: A key that would hold a prompt, a response or a secret.
            TypeError: A value that is not a scalar.
        """
        if self._tracer is not None:
            self.attributes.update(_check_attributes(attributes))

    def __enter__(self) -> Span:
        if self._tracer is not None:
            self._token = _OPEN.set((self.trace_id, self.span_id, self.chain))
            self.start_ns = time.time_ns()
            self._perf_start = time.perf_counter_ns()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        if self._tracer is None:
            return False
        # wall-clock start, monotonic duration: a clock adjustment mid-span gives no negative duration
        end_ns = self.start_ns + (time.perf_counter_ns() - self._perf_start)
        if self._token is not None:
            try:
                _OPEN.reset(self._token)
            except ValueError:  # exited in another context (a generator resumed elsewhere): drop this span's frame
                _OPEN.set(None)
            self._token = None
        status = "ok"
        if exc_type is not None:
            status = "error"
            self.attributes["error"] = exc_type.__name__
        self._tracer._record(self, end_ns, status)
        return False


class Tracer:
    """Writes spans of one run.

    Spans are kept in memory and appended to the JSON lines file (one object per line) by :meth:`flush` and
    :meth:`close` (and every ``flush_every`` spans); recording and flushing are thread-safe (a producer thread and the
    trainer thread both record spans). With ``otlp_endpoint`` every span is also exported through OpenTelemetry's
    OTLP HTTP exporter (in the background; :meth:`close` sends what is left), with the same trace and span ids as in
    the file.

    Each line: ``{"trace_id", "span_id", "parent_id", "name", "stage", "start_ns", "end_ns", "duration_s", "step",
    "samples", "status", "attributes", "chain"}``; ``status`` is ``"ok"``, or ``"error"`` when the span's body raised
    (the exception's type name in ``attributes["error"]``).
    """

    def __init__(
        self,
        path: str | Path | None,
        otlp_endpoint: str | None = None,
        service_name: str = "xtl",
        *,
        flush_every: int = 1000,
        exporter: Any = None,
    ) -> None:
        """Opens a trace (a new trace id; the file is appended to, its parent directory created).

        Args:
            path: The JSON lines file; ``None``: no file.
            otlp_endpoint: An OTLP HTTP collector (``"http://localhost:4318"``; ``/v1/traces`` is added) to export
                every span to as well (``pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http``).
            service_name: The OpenTelemetry ``service.name`` of the exported spans.
            flush_every: Spans kept in memory before they are written without waiting for :meth:`flush`.
            exporter: An OpenTelemetry ``SpanExporter`` to export every span to as it ends (synchronously; tests use
                ``InMemorySpanExporter``).

        Raises:
            ImportError: ``otlp_endpoint`` or ``exporter`` without ``opentelemetry-sdk`` (and, for the endpoint,
                ``opentelemetry-exporter-otlp-proto-http``).
        """
        self._path = Path(path) if path is not None else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
        self._trace_id = _new_id(16)
        self._flush_every = max(1, int(flush_every))
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._checked_tail = False
        self._otel = _OtelExport(service_name, otlp_endpoint, exporter) if otlp_endpoint or exporter else None

    @property
    def path(self) -> Path | None:
        """The JSON lines file (``None``: spans are not written to a file)."""
        return self._path

    @property
    def trace_id(self) -> str:
        """This run's trace id (32 hex digits)."""
        return self._trace_id

    def span(
        self,
        name: str,
        stage: str,
        samples: Sequence[str] = (),
        step: int | None = None,
        *,
        parent: dict[str, str] | None = None,
        **attributes: Any,
    ) -> Span:
        """A span to open with ``with``: timed from entry to exit, recorded on exit.

        Args:
            name: What runs (``"generate"``, a tool's name).
            stage: The stage: ``"agent_loop"``, ``"generate"``, ``"tool"``, ``"judge"``, ``"filter"``, ``"train"``.
            samples: Ids of the samples it covers (a single id may be passed as a string).
            step: The training step.
            parent: A :func:`carrier` from another thread or process to continue from (its trace id, parent span
                and chain); ``None``: the innermost span open in this thread or task, if any.
            **attributes: str, int, float or bool values (strings cut to 200 characters).

        Returns:
            The span (a context manager yielding itself; :meth:`Span.set` adds attributes while it runs).

        Raises:
            ValueError: An attribute key that would hold a prompt, a response or a secret (``prompt``, ``response``,
                ``messages``, ``text``, ``content``, ``api_key``, ``secret``, ``token``, ``tokens``).
            TypeError: An attribute value that is not a scalar.
        """
        return Span(self, str(name), str(stage), _sample_ids(samples), _step(step), _check_attributes(attributes),
                    _parent(parent))  # fmt: skip

    def event(
        self,
        name: str,
        stage: str,
        samples: Sequence[str] = (),
        step: int | None = None,
        *,
        parent: dict[str, str] | None = None,
        **attributes: Any,
    ) -> None:
        """Records a zero-length span (a filter decision, an abort) under the innermost open span.

        Args:
            name: What happened.
            stage: The stage it belongs to.
            samples: Ids of the samples it concerns.
            step: The training step.
            parent: A :func:`carrier` to continue from (``None``: the innermost open span).
            **attributes: As for :meth:`span`.

        Raises:
            ValueError: A refused attribute key.
            TypeError: An attribute value that is not a scalar.
        """
        span = self.span(name, stage, samples, step, parent=parent, **attributes)
        span.start_ns = time.time_ns()
        self._record(span, span.start_ns, "ok")

    def flush(self) -> None:
        """Appends the spans recorded so far to the file (nothing without a path)."""
        with self._lock:
            self._write_pending()

    def close(self) -> None:
        """Flushes, and sends the spans left to the OTLP exporter and shuts it down (the file stays appendable)."""
        self.flush()
        if self._otel is not None:
            self._otel.shutdown()

    def _record(self, span: Span, end_ns: int, status: str) -> None:
        """Keeps one finished span (and exports it)."""
        record = {
            "trace_id": span.trace_id,
            "span_id": span.span_id,
            "parent_id": span.parent_id,
            "name": span.name,
            "stage": span.stage,
            "start_ns": span.start_ns,
            "end_ns": end_ns,
            "duration_s": (end_ns - span.start_ns) / 1e9,
            "step": span.step,
            "samples": list(span.samples),
            "status": status,
            "attributes": dict(span.attributes),
            "chain": span.chain,
        }
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._pending.append(line)
            if len(self._pending) >= self._flush_every:
                self._write_pending()
        if self._otel is not None:
            self._otel.export(record)

    def _write_pending(self) -> None:
        """Appends the pending lines in one write (the caller holds the lock)."""
        if not self._pending:
            return
        if self._path is None:
            self._pending.clear()
            return
        text = "\n".join(self._pending) + "\n"
        if not self._checked_tail:
            # a run that died mid-write left a torn last line: start on a new line so ours stay whole
            self._checked_tail = True
            if self._path.exists() and self._path.stat().st_size:
                with open(self._path, "rb") as handle:
                    handle.seek(-1, os.SEEK_END)
                    if handle.read(1) != b"\n":
                        text = "\n" + text
        data = text.encode()
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        self._pending.clear()


class _NullTracer(Tracer):
    """A tracer that records nothing (its spans time nothing and their ``set`` does nothing)."""

    def __init__(self) -> None:
        """A tracer with no file, no exporter and no trace id."""
        self._path = None
        self._trace_id = ""

    def span(
        self,
        name: str,
        stage: str,
        samples: Sequence[str] = (),
        step: int | None = None,
        *,
        parent: dict[str, str] | None = None,
        **attributes: Any,
    ) -> Span:
        """A span that does nothing.

        Args:
            name: Ignored.
            stage: Ignored.
            samples: Ignored.
            step: Ignored.
            parent: Ignored.
            **attributes: Ignored.

        Returns:
            A context manager yielding a span whose ``set`` does nothing.
        """
        return _NULL_SPAN

    def event(
        self,
        name: str,
        stage: str,
        samples: Sequence[str] = (),
        step: int | None = None,
        *,
        parent: dict[str, str] | None = None,
        **attributes: Any,
    ) -> None:
        """Does nothing.

        Args:
            name: Ignored.
            stage: Ignored.
            samples: Ignored.
            step: Ignored.
            parent: Ignored.
            **attributes: Ignored.
        """

    def flush(self) -> None:
        """Does nothing."""

    def close(self) -> None:
        """Does nothing."""


_NULL_SPAN = Span(None, "", "", (), None, {}, None)

NULL_TRACER: Tracer = _NullTracer()
"""The tracer that records nothing (the active one until :func:`activate` sets another)."""

_active: Tracer = NULL_TRACER


def current() -> Tracer:
    """The process's active tracer.

    Returns:
        The tracer set by :func:`activate`, :data:`NULL_TRACER` when none is.
    """
    return _active


def activate(tracer: Tracer | None) -> None:
    """Sets the process's active tracer (every thread's).

    Args:
        tracer: The tracer; ``None``: :data:`NULL_TRACER` again.
    """
    global _active
    _active = tracer if tracer is not None else NULL_TRACER


def carrier() -> dict[str, str]:
    """What another thread or process needs to continue the current sample's chain (``tracer.span(...,
    parent=carrier)``): plain strings, picklable and JSON-serializable.

    Returns:
        ``{"trace_id", "span_id", "chain"}`` of the innermost span open in this thread or task; outside any span,
        ``{"trace_id"}`` of the active tracer, or ``{}`` when none is active.
    """
    frame = _OPEN.get()
    if frame is not None:
        trace_id, span_id, chain = frame
        return {"trace_id": trace_id, "span_id": span_id, "chain": chain}
    trace_id = current().trace_id
    return {"trace_id": trace_id} if trace_id else {}


def _sample_ids(samples: Sequence[str] | str) -> tuple[str, ...]:
    """Sample ids as strings (a single id may be passed as a string)."""
    if isinstance(samples, str):
        return (samples,)
    return tuple(str(sample) for sample in samples)


def _step(step: int | None) -> int | None:
    """A step as an int (``None`` stays)."""
    if step is None:
        return None
    if isinstance(step, bool):
        raise TypeError("a span's step must be an int or None, got bool")
    try:
        return operator.index(step)  # ints and integer scalars (numpy, 0-d tensors)
    except TypeError:
        raise TypeError(f"a span's step must be an int or None, got {type(step).__name__}") from None


def _parent(parent: dict[str, str] | None) -> tuple[str, str, str] | None:
    """The parent frame of a new span: the carrier's when given, else the innermost open span's."""
    if parent is None:
        return _OPEN.get()
    if not parent.get("span_id"):
        return None if not parent.get("trace_id") else (parent["trace_id"], "", "")
    return str(parent.get("trace_id", "")), str(parent["span_id"]), str(parent.get("chain", ""))


class _OtelExport:
    """Sends finished spans to OpenTelemetry span processors, with the JSON lines' ids and times."""

    def __init__(self, service_name: str, endpoint: str | None, exporter: Any) -> None:
        """Builds the processors.

        Args:
            service_name: The resource's ``service.name``.
            endpoint: An OTLP HTTP collector (batched export) or ``None``.
            exporter: A ``SpanExporter`` (synchronous export) or ``None``.
        """
        hint = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
        try:
            from opentelemetry import trace as otel_trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import ReadableSpan
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError as error:
            raise ImportError(f"exporting traces through OpenTelemetry needs opentelemetry-sdk: {hint}") from error
        self._trace = otel_trace
        self._readable = ReadableSpan
        self._resource = Resource.create({"service.name": service_name})
        self._scope = InstrumentationScope("xtl.rl.trace")
        self._processors: list[Any] = []
        if exporter is not None:
            self._processors.append(SimpleSpanProcessor(exporter))
        if endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as error:
                raise ImportError(f"exporting traces to an OTLP endpoint needs its HTTP exporter: {hint}") from error
            url = endpoint.rstrip("/")
            if not url.endswith("/v1/traces"):
                url += "/v1/traces"
            self._processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))

    def export(self, record: dict[str, Any]) -> None:
        """Exports one span record.

        Args:
            record: A span as written to the JSON lines file.
        """
        trace = self._trace
        flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
        trace_id = int(record["trace_id"], 16)
        context = trace.SpanContext(trace_id, int(record["span_id"], 16), is_remote=False, trace_flags=flags)
        parent = None
        if record["parent_id"]:
            parent = trace.SpanContext(trace_id, int(record["parent_id"], 16), is_remote=True, trace_flags=flags)
        attributes: dict[str, Any] = dict(record["attributes"])
        attributes["xtl.stage"] = record["stage"]
        attributes["xtl.chain"] = record["chain"]
        attributes["xtl.samples"] = list(record["samples"])
        if record["step"] is not None:
            attributes["xtl.step"] = record["step"]
        if record["status"] == "error":
            status = trace.Status(trace.StatusCode.ERROR, str(record["attributes"].get("error", "")))
        else:
            status = trace.Status(trace.StatusCode.OK)
        span = self._readable(
            name=record["name"],
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            status=status,
            start_time=record["start_ns"],
            end_time=record["end_ns"],
            instrumentation_scope=self._scope,
        )
        for processor in self._processors:
            processor.on_end(span)

    def shutdown(self) -> None:
        """Sends what is left and stops the processors."""
        for processor in self._processors:
            processor.shutdown()
        self._processors = []
