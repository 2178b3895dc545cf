"""One self-contained HTML page from a run's ``traces.jsonl`` (:mod:`xtl.rl.trace`).

``python -m xtl.rl.trace_viewer runs/x/traces.jsonl [--out page.html]`` writes the page (by default beside the
trace, with ``.html``) and prints its path. The page needs nothing but a browser: the data is embedded as JSON (in
``<script type="application/json" id="xtl-trace-data">``), the script is plain JavaScript. It lists the steps;
a step shows its samples (status, reward, filter reason, seconds per stage, wall time; sortable by any column), the
samples per status, and a time-line: one bar per sample from its first span's start to its last span's end, the
spans on it coloured by stage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["load_spans", "main", "summarize", "write_page"]

# attributes the page reads, set on a span for all its samples (``status``) or for one (``status.<sample id>``)
_SAMPLE_FIELDS = ("status", "reward", "filter_reason", "finish_reason")


def load_spans(path: str | Path) -> list[dict]:
    """Reads the spans of a ``traces.jsonl``.

    A torn last line (a run stopped mid-write) is skipped; another line that is not a JSON object is skipped with
    a warning (a torn line that a resumed run wrote after).

    Args:
        path: The JSON lines file.

    Returns:
        The spans, in file order.
    """
    lines = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
    last = max((index for index, line in enumerate(lines) if line.strip()), default=-1)
    spans = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            span = json.loads(line)
        except json.JSONDecodeError:
            span = None
        if not isinstance(span, dict):
            if index != last:
                warnings.warn(f"{path}:{index + 1}: not a JSON object, skipped", stacklevel=2)
            continue
        spans.append(span)
    return spans


def _natural_key(sample_id: str) -> tuple:
    """Sorts ``"s2"`` before ``"s10"``."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", sample_id))


def _step_key(step: int | None) -> tuple[int, int]:
    return (1, 0) if step is None else (0, step)


def _sample_steps(spans: list[dict]) -> dict[str, list[int]]:
    """The steps each sample id appears at (spans with a step)."""
    steps: dict[str, set[int]] = defaultdict(set)
    for span in spans:
        if span.get("step") is not None:
            for sample in span.get("samples") or ():
                steps[str(sample)].add(int(span["step"]))
    return {sample: sorted(found) for sample, found in steps.items()}


def summarize(spans: list[dict]) -> dict:
    """The page's data: per step, per sample, the time spent in each stage and what became of it.

    A span without a step counts at its sample's step (the first, if the sample appears at several). A sample's
    ``status``, ``reward``, ``filter_reason`` and ``finish_reason`` are the attributes of the spans listing it, the
    last span (by end time) that sets one winning; a span covering several samples sets one sample's value with the
    attribute ``<field>.<sample id>`` (a batched judge span: ``reward.s1``), which wins over its plain ``<field>``.
    A sample with no ``status`` attribute is ``"error"`` if one of its spans raised, else ``"unknown"``.

    Args:
        spans: Spans as written by :class:`xtl.rl.trace.Tracer` (:func:`load_spans`).

    Returns:
        ``{"steps": [{"step", "start_ns", "end_ns", "stages": {stage: seconds, each span once}, "counts": {status:
        samples}, "samples": [{"id", "stages": {stage: seconds summed over the spans listing it}, "status",
        "reward", "filter_reason", "finish_reason", "start_ns", "end_ns", "seconds" (end - start), "chain": [distinct
        chains], "segments": [{"name", "stage", "start_s", "end_s"} relative to the step's start, outer spans
        first]}, ...]}, ...]}``, steps by step (spans with no step at all last, as step ``None``), samples by id.
    """
    sample_steps = _sample_steps(spans)
    ordered = sorted(enumerate(spans), key=lambda item: (int(item[1].get("end_ns") or 0), item[0]))
    steps: dict[int | None, dict[str, Any]] = {}
    for _, span in ordered:
        start_ns, end_ns = int(span.get("start_ns") or 0), int(span.get("end_ns") or 0)
        stage = str(span.get("stage", ""))
        duration = float(span.get("duration_s") or 0.0)
        attributes = span.get("attributes") or {}
        samples = [str(sample) for sample in span.get("samples") or ()]
        span_steps: set[int | None] = set()
        for sample in samples:
            step = span.get("step")
            if step is None:
                step = sample_steps.get(sample, [None])[0]
            span_steps.add(step)
            entry = _step_entry(steps, step)
            record = entry["samples"].get(sample)
            if record is None:
                record = entry["samples"][sample] = {
                    "id": sample, "stages": {}, "status": None, "reward": None, "filter_reason": None,
                    "finish_reason": None, "start_ns": start_ns, "end_ns": end_ns, "chain": [], "segments": [],
                    "_errors": 0,
                }  # fmt: skip
            record["stages"][stage] = record["stages"].get(stage, 0.0) + duration
            record["start_ns"] = min(record["start_ns"], start_ns)
            record["end_ns"] = max(record["end_ns"], end_ns)
            chain = str(span.get("chain", ""))
            if chain not in record["chain"]:
                record["chain"].append(chain)
            record["segments"].append((chain.count(" -> "), start_ns, end_ns, str(span.get("name", "")), stage))
            record["_errors"] += span.get("status") == "error"
            for field in _SAMPLE_FIELDS:
                value = attributes.get(f"{field}.{sample}", attributes.get(field))
                if value is not None:
                    record[field] = value
        if not samples:
            span_steps.add(span.get("step"))
        for step in span_steps:
            entry = _step_entry(steps, step)
            entry["stages"][stage] = entry["stages"].get(stage, 0.0) + duration
            entry["start_ns"] = start_ns if entry["start_ns"] is None else min(entry["start_ns"], start_ns)
            entry["end_ns"] = end_ns if entry["end_ns"] is None else max(entry["end_ns"], end_ns)
    result = []
    for step in sorted(steps, key=_step_key):
        entry = steps[step]
        origin = entry["start_ns"] or 0
        samples = []
        for sample_id in sorted(entry["samples"], key=_natural_key):
            record = entry["samples"][sample_id]
            errors = record.pop("_errors")
            if record["status"] is None:
                record["status"] = "error" if errors else "unknown"
            record["status"] = str(record["status"])
            record["seconds"] = (record["end_ns"] - record["start_ns"]) / 1e9
            record["segments"] = [
                {"name": name, "stage": stage, "start_s": (start - origin) / 1e9, "end_s": (end - origin) / 1e9}
                for _, start, end, name, stage in sorted(record["segments"], key=lambda seg: (seg[0], seg[1]))
            ]
            samples.append(record)
        counts: dict[str, int] = {}
        for record in samples:
            counts[record["status"]] = counts.get(record["status"], 0) + 1
        result.append({"step": step, "start_ns": entry["start_ns"], "end_ns": entry["end_ns"],
                       "stages": entry["stages"], "counts": counts, "samples": samples})  # fmt: skip
    return {"steps": result}


def _step_entry(steps: dict[int | None, dict[str, Any]], step: int | None) -> dict[str, Any]:
    if step not in steps:
        steps[step] = {"samples": {}, "stages": {}, "start_ns": None, "end_ns": None}
    return steps[step]


def _finite(value: Any) -> Any:
    """The data with non-finite floats as ``None`` (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _embed(data: dict) -> str:
    """JSON safe inside a ``<script>`` element (no ``<``, ``>`` or ``&`` left to end it)."""
    text = json.dumps(_finite(data), allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>xtl rollout trace: __TITLE__</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; display: flex; height: 100vh; color: #222; }
#steps { width: 9em; overflow-y: auto; border-right: 1px solid #ccc; padding: 0.5em; flex: none; }
#steps div { cursor: pointer; padding: 2px 6px; border-radius: 3px; }
#steps div.on { background: #2b6cb0; color: #fff; }
#main { flex: 1; overflow: auto; padding: 0.5em 1em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; white-space: nowrap; }
th { cursor: pointer; background: #f4f4f4; }
td.l, th.l { text-align: left; }
.row { display: flex; align-items: center; height: 16px; margin: 1px 0; }
.row .id { width: 10em; flex: none; overflow: hidden; text-overflow: ellipsis; }
.lane { position: relative; flex: 1; height: 12px; background: #f6f6f6; }
.lane div { position: absolute; top: 0; height: 12px; min-width: 1px; }
.key span { display: inline-block; margin-right: 1em; }
.key i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: middle; }
</style>
</head>
<body>
<div id="steps"></div>
<div id="main"></div>
<script type="application/json" id="xtl-trace-data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("xtl-trace-data").textContent);
const PALETTE = {agent_loop: "#cbd5e0", generate: "#4299e1", tool: "#ed8936", judge: "#48bb78", filter: "#e53e3e",
                 train: "#9f7aea"};
const EXTRA = ["#38b2ac", "#d69e2e", "#ed64a6", "#718096", "#667eea", "#f56565"];
function colour(stage) {
  if (!(stage in PALETTE)) PALETTE[stage] = EXTRA[Object.keys(PALETTE).length % EXTRA.length];
  return PALETTE[stage];
}
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  if (cls) node.className = cls;
  return node;
}
function fmt(value) {
  if (value === null || value === undefined) return "";
  if (typeof value !== "number" || Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 1 ? value.toFixed(3) : value.toPrecision(3);
}
let sortKey = "id", sortDown = false, current = null;
function show(index) {
  current = index;
  const step = data.steps[index];
  document.querySelectorAll("#steps div").forEach((d, i) => d.classList.toggle("on", i === index));
  const main = document.getElementById("main");
  main.replaceChildren();
  main.appendChild(el("h3", "step " + (step.step === null ? "(none)" : step.step) + ": " + step.samples.length +
                         " samples"));
  main.appendChild(el("div", Object.entries(step.counts).map(([s, n]) => s + ": " + n).join("   ")));
  const stages = [];
  step.samples.forEach(s => Object.keys(s.stages).forEach(k => { if (!stages.includes(k)) stages.push(k); }));
  const columns = [["id", "sample", s => s.id], ["status", "status", s => s.status],
                   ["reward", "reward", s => s.reward], ["filter_reason", "filter reason", s => s.filter_reason]]
    .concat(stages.map(k => ["stage:" + k, k + " s", s => s.stages[k] === undefined ? null : s.stages[k]]))
    .concat([["seconds", "wall s", s => s.seconds]]);
  const getter = (columns.find(c => c[0] === sortKey) || columns[0])[2];
  const rows = step.samples.slice().sort((a, b) => {
    const x = getter(a), y = getter(b);
    if (x === null || y === null) return (x === null) - (y === null);  // empty cells last either way
    const order = typeof x === "number" && typeof y === "number" ? x - y :
      String(x).localeCompare(String(y), undefined, {numeric: true});
    return sortDown ? -order : order;
  });
  const table = el("table"), head = el("tr");
  columns.forEach(([key, label], i) => {
    const th = el("th", label + (key === sortKey ? (sortDown ? " \\u25BC" : " \\u25B2") : ""), i < 4 ? "l" : "");
    th.onclick = () => { sortDown = key === sortKey ? !sortDown : false; sortKey = key; show(current); };
    head.appendChild(th);
  });
  table.appendChild(head);
  rows.forEach(s => {
    const tr = el("tr");
    columns.forEach(([key, , get], i) => tr.appendChild(el("td", fmt(get(s)), i < 4 ? "l" : "")));
    tr.title = s.chain.join("\\n");
    table.appendChild(tr);
  });
  main.appendChild(table);
  const span = Math.max(1e-9, (step.end_ns - step.start_ns) / 1e9);
  main.appendChild(el("h4", "time-line (" + span.toFixed(3) + " s)"));
  const key = el("div", null, "key");
  stages.forEach(k => { const item = el("span", k); const box = el("i"); box.style.background = colour(k);
                        item.prepend(box); key.appendChild(item); });
  main.appendChild(key);
  rows.forEach(s => {
    const row = el("div", null, "row"), lane = el("div", null, "lane");
    row.appendChild(el("span", s.id, "id"));
    s.segments.forEach(g => {
      const bar = el("div");
      bar.style.left = (100 * g.start_s / span) + "%";
      bar.style.width = (100 * (g.end_s - g.start_s) / span) + "%";
      bar.style.background = colour(g.stage);
      bar.title = g.name + " (" + g.stage + "): " + (g.end_s - g.start_s).toFixed(3) + " s";
      lane.appendChild(bar);
    });
    row.appendChild(lane);
    main.appendChild(row);
  });
}
const list = document.getElementById("steps");
data.steps.forEach((step, i) => {
  const item = el("div", "step " + (step.step === null ? "(none)" : step.step));
  item.onclick = () => show(i);
  list.appendChild(item);
});
if (data.steps.length) show(0); else document.getElementById("main").textContent = "no spans";
</script>
</body>
</html>
"""


def write_page(trace_path: str | Path, page_path: str | Path | None = None) -> Path:
    """Writes the HTML page of a trace (to a temporary name, then renamed: a reader never sees half a page).

    Args:
        trace_path: The run's ``traces.jsonl``.
        page_path: Where to write the page; ``None``: ``trace_path`` with the suffix ``.html``.

    Returns:
        The page's path.
    """
    trace_path = Path(trace_path)
    page = Path(page_path) if page_path is not None else trace_path.with_suffix(".html")
    title = trace_path.name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    fills = {"__TITLE__": title, "__DATA__": _embed(summarize(load_spans(trace_path)))}
    html = re.sub("__TITLE__|__DATA__", lambda match: fills[match.group(0)], _PAGE)
    page.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=page.parent, prefix=f".{page.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(html)
        os.chmod(temporary, 0o644)
        os.replace(temporary, page)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return page


def main(argv: list[str] | None = None) -> int:
    """``python -m xtl.rl.trace_viewer runs/x/traces.jsonl [--out page.html]``: writes the page, prints its path.

    Args:
        argv: The arguments (``None``: the command line's).

    Returns:
        0, or 1 when the trace file does not exist.
    """
    parser = argparse.ArgumentParser(prog="python -m xtl.rl.trace_viewer", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="the run's traces.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="the page (default: the trace with .html)")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f"no trace file at {args.trace}", file=sys.stderr)
        return 1
    print(write_page(args.trace, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
