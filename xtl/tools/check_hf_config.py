"""``xtl check-hf-config``: compare xtl's ``from_hf -> save`` config.json with what transformers itself writes.

The reference is ``AutoConfig.from_pretrained(src).save_pretrained(tmp)`` with the installed transformers (not
the raw source file: transformers may legitimately add defaults or normalize fields). The xtl side is
``get_model_config_from_hf(src).hf_config.save_pretrained(tmp)``. Both ``config.json`` files are diffed as JSON
trees; every difference is reported with its JSON pointer (RFC 6901) as missing (in the reference, absent from the
export), extra (only in the export) or changed. Tests can also pin inference-engine field contracts
(:class:`HFConfigFieldDependency`) and allow specific differences, each with a mandatory reason.

Example:
    >>> from xtl.tools.check_hf_config import compare_configs
    >>> compare_configs({"a": {"b": 1}}, {"a": {}}).differences[0].path
    '/a/b'
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from xtl.tools._cli import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, ToolInputError, make_parser, run_cli

EXAMPLES = f"""examples:
  xtl check-hf-config path/to/hf_model
  xtl check-hf-config path/to/hf_model --allow /rope_scaling="xtl writes rope_parameters only" --format json

{EXIT_CODES_HELP} (1: differences found; with --strict also an --allow that matches none)"""

_MISSING = object()


@dataclass(frozen=True)
class JsonDifference:
    """One difference between the reference and the exported JSON."""

    path: str
    kind: Literal["missing", "extra", "changed"]
    expected: Any = None
    actual: Any = None

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"missing {self.path} (reference: {self.expected!r})"
        if self.kind == "extra":
            return f"extra   {self.path} (export: {self.actual!r})"
        return f"changed {self.path}: reference {self.expected!r} != export {self.actual!r}"


@dataclass(frozen=True)
class HFConfigFieldDependency:
    """A config.json field an inference engine reads to build the model or load its weights.

    Args:
        engine (str): Engine name, e.g. ``"vllm"``.
        version (str): Exact audited version, e.g. ``"0.10.1"`` (never ``latest``).
        path (str): JSON pointer of the field, e.g. ``"/num_experts"``.
        expected (Any): Value the export must hold.
        reason (str): Why the engine needs it (module registration, weight-loader key, routing, ...).
        source (str): Permalink to the engine source line(s) audited.
    """

    engine: str
    version: str
    path: str
    expected: Any
    reason: str
    source: str = ""


@dataclass
class HFConfigReport:
    """Result of a config comparison.

    Attributes:
        strict_allowances: A stale allowance (one that matches no difference) fails the check (the API's rule, so
            test allowance lists stay current); the command reports it as a note unless ``--strict``.
    """

    differences: list[JsonDifference] = field(default_factory=list)
    allowed: list[tuple[JsonDifference, str]] = field(default_factory=list)
    unused_allowances: list[str] = field(default_factory=list)
    engine_failures: list[str] = field(default_factory=list)
    checked_engine_versions: tuple[str, ...] = ()
    transformers_version: str = ""
    strict_allowances: bool = True

    @property
    def ok(self) -> bool:
        """bool: No unexplained difference, no violated engine contract, no stale allowance (when strict)."""
        stale = self.unused_allowances if self.strict_allowances else []
        return not (self.differences or self.engine_failures or stale)

    def render(self) -> str:
        """Return a human-readable report.

        Returns:
            str: Report text.
        """
        lines = [str(d) for d in self.differences]
        lines += [f"allowed {d.path}: {reason}" for d, reason in self.allowed]
        stale = "stale allowance" if self.strict_allowances else "note: unused allowance"
        lines += [f"{stale} {p}: no such difference any more" for p in self.unused_allowances]
        lines += self.engine_failures
        problems = (
            len(self.differences) + len(self.engine_failures) + len(self.unused_allowances) * self.strict_allowances
        )
        lines.append("OK: export matches transformers" if self.ok else f"FAILED: {problems} problem(s)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Return a JSON-serializable dict.

        Returns:
            dict: The report.
        """
        return {
            "ok": self.ok,
            "differences": [vars(d) for d in self.differences],
            "allowed": [{"path": d.path, "kind": d.kind, "reason": r} for d, r in self.allowed],
            "unused_allowances": self.unused_allowances,
            "engine_failures": self.engine_failures,
            "checked_engine_versions": list(self.checked_engine_versions),
            "transformers_version": self.transformers_version,
        }


def diff_json(expected: Any, actual: Any, path: str = "") -> list[JsonDifference]:
    """Recursively diff two JSON values; dicts by key, lists element-wise when their lengths match.

    Args:
        expected (Any): Reference value.
        actual (Any): Exported value.
        path (str): JSON pointer of the values (``""`` for the root).

    Returns:
        list[JsonDifference]: Differences sorted by path.
    """
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(expected.keys() | actual.keys()):
            sub = f"{path}/{_escape(str(key))}"
            if key not in actual:
                out.append(JsonDifference(sub, "missing", expected=expected[key]))
            elif key not in expected:
                out.append(JsonDifference(sub, "extra", actual=actual[key]))
            else:
                out.extend(diff_json(expected[key], actual[key], sub))
        return out
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [
            d for i, (e, a) in enumerate(zip(expected, actual, strict=True)) for d in diff_json(e, a, f"{path}/{i}")
        ]
    if type(expected) is not type(actual) or expected != actual:  # strict: 1 vs 1.0 and true vs 1 differ
        return [JsonDifference(path or "/", "changed", expected=expected, actual=actual)]
    return []


def resolve_pointer(document: Any, pointer: str) -> Any:
    """Return the value at JSON pointer ``pointer`` or a private sentinel when it does not exist.

    Args:
        document (Any): JSON document.
        pointer (str): RFC 6901 pointer such as ``"/rope_scaling/factor"``.

    Returns:
        Any: The value (``_MISSING`` sentinel when absent).
    """
    node = document
    for token in pointer.split("/")[1:] if pointer else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return _MISSING
    return node


def compare_configs(
    reference: dict,
    exported: dict,
    allowed_export_differences: dict[str, str] | None = None,
    engine_dependencies: tuple[HFConfigFieldDependency, ...] = (),
) -> HFConfigReport:
    """Compare an exported config.json with the transformers reference and check engine contracts.

    Args:
        reference (dict): What transformers writes for the source.
        exported (dict): What xtl writes.
        allowed_export_differences (dict[str, str] | None): JSON pointer -> non-empty reason for an intentional
            difference; an allowance that matches no difference is reported as stale.
        engine_dependencies (tuple[HFConfigFieldDependency, ...]): Field contracts the export must satisfy.

    Returns:
        HFConfigReport: The report (``report.ok`` tells whether it passed).
    """
    allowed = dict(allowed_export_differences or {})
    for pointer, reason in allowed.items():
        if not str(reason).strip():
            raise ValueError(f"allowed difference {pointer} needs a non-empty reason")
    report = HFConfigReport()
    used = set()
    for diff in diff_json(reference, exported):
        if diff.path in allowed:
            report.allowed.append((diff, allowed[diff.path]))
            used.add(diff.path)
        else:
            report.differences.append(diff)
    report.unused_allowances = sorted(allowed.keys() - used)
    versions = []
    for dep in engine_dependencies:
        if not dep.reason.strip() or not dep.version[:1].isdigit():
            raise ValueError(f"{dep.engine} dependency {dep.path} needs an exact version and a reason")
        versions.append(f"{dep.engine}=={dep.version}")
        value = resolve_pointer(exported, dep.path)
        if value is _MISSING or value != dep.expected or _bool_vs_int(value, dep.expected):
            shown = "absent" if value is _MISSING else repr(value)
            report.engine_failures.append(
                f"{dep.engine}=={dep.version} needs {dep.path} == {dep.expected!r}, export has {shown}: {dep.reason}"
            )
    report.checked_engine_versions = tuple(dict.fromkeys(versions))
    return report


def transformers_reference(src: str | Path) -> dict:
    """Return the config.json the installed transformers writes for ``src`` (load + save round trip).

    Args:
        src (str | Path): HF model directory.

    Returns:
        dict: The written JSON.
    """
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        AutoConfig.from_pretrained(src).save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def xtl_export(src: str | Path, config: Any = None) -> dict:
    """Return the config.json xtl writes for ``src`` through ``get_model_config_from_hf(src).hf_config``.

    For a block-fp8 checkpoint (``quantization_config`` with ``weight_block_size``) the export is the one
    ``save_hf(fp8="blockwise")`` writes: its ``quantization_config`` is built from the checkpoint's tensor names
    (:func:`xtl.model.hf.checkpoint_quantization_config`), not copied from the source.

    Args:
        src (str | Path): HF model directory.
        config (Any): An already-built xtl model config (built from ``src`` when omitted).

    Returns:
        dict: The written JSON.
    """
    if config is None:
        from xtl.model import get_model_config_from_hf

        config = get_model_config_from_hf(src)
    hf_config = config.hf_config
    if hf_config is None:
        raise ToolInputError(f"{type(config).__name__}.hf_config is None (remote-code model): nothing to compare")
    from xtl.model.hf import checkpoint_quantization_config

    quantization = checkpoint_quantization_config(src)
    if quantization is not None:
        hf_config.quantization_config = quantization
    with tempfile.TemporaryDirectory() as tmp:
        hf_config.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def check_hf_config_save(
    src: str | Path,
    config: Any = None,
    *,
    allowed_export_differences: dict[str, str] | None = None,
    engine_dependencies: tuple[HFConfigFieldDependency, ...] = (),
    raise_on_failure: bool = True,
) -> HFConfigReport:
    """Test helper: xtl's export of ``src`` must equal transformers' own round trip and satisfy engine contracts.

    Args:
        src (str | Path): HF model directory (its ``config.json`` must load with the installed transformers).
        config (Any): xtl model config built from ``src`` (built with ``get_model_config_from_hf`` if omitted).
        allowed_export_differences (dict[str, str] | None): JSON pointer -> reason for intentional differences.
        engine_dependencies (tuple[HFConfigFieldDependency, ...]): Inference-engine field contracts.
        raise_on_failure (bool): Raise ``AssertionError`` with the rendered report when the check fails.

    Returns:
        HFConfigReport: The report.
    """
    import transformers

    report = compare_configs(
        transformers_reference(src), xtl_export(src, config), allowed_export_differences, engine_dependencies
    )
    report.transformers_version = transformers.__version__
    if raise_on_failure and not report.ok:
        raise AssertionError(f"xtl config export of {src} differs from transformers:\n{report.render()}")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check-hf-config`` options to ``parser``.

    Args:
        parser (argparse.ArgumentParser): Parser.
    """
    parser.add_argument("src", type=Path, help="HF model directory with config.json")
    parser.add_argument(
        "--allow", action="append", default=[], metavar="POINTER=REASON", help="accept one difference, with a reason"
    )
    parser.add_argument(
        "--strict", action="store_true", help="an --allow that matches no difference fails the check (for CI)"
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    """Run ``check-hf-config`` from parsed arguments.

    Args:
        args (argparse.Namespace): Parsed ``add_arguments`` options.

    Returns:
        int: Exit code.
    """
    if not (args.src / "config.json").is_file():
        raise ToolInputError(f"{args.src / 'config.json'} not found")
    allowed = {}
    for item in args.allow:
        pointer, sep, reason = item.partition("=")
        if not sep or not pointer.startswith("/") or not reason.strip():
            raise ToolInputError(f"--allow {item!r}: expected /json/pointer=reason")
        allowed[pointer] = reason
    try:
        report = check_hf_config_save(args.src, allowed_export_differences=allowed, raise_on_failure=False)
        report.strict_allowances = args.strict
    except ImportError as exc:
        raise ToolInputError(f"xtl.model is not importable: {exc}") from exc
    except ValueError as exc:  # get_model_config_from_hf rejects an unsupported model_type
        raise ToolInputError(str(exc)) from exc
    print(json.dumps(report.to_dict(), indent=2, default=repr) if args.format == "json" else report.render())
    return EXIT_OK if report.ok else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``xtl check-hf-config``.

    Args:
        argv (list[str] | None): Arguments (without the program name).

    Returns:
        int: Exit code (0 equal, 1 differences found, 2 usage or input error).
    """
    parser = make_parser("xtl check-hf-config", "Compare xtl's config.json export with transformers'.", EXAMPLES)
    add_arguments(parser)
    return run_cli(parser, argv, run)


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _bool_vs_int(a: Any, b: Any) -> bool:
    return isinstance(a, bool) != isinstance(b, bool)


if __name__ == "__main__":
    raise SystemExit(main())
