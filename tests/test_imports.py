"""The import graph of ``xtl`` (no cycles between modules, no package importing one of a higher layer) and its
seams (parts and traits reached by type, never recognized by name: :class:`TestSeams`).

Edges are every ``import`` of an ``xtl`` module in the source (function-level ones included, ``TYPE_CHECKING``
blocks left out unless asked for), read with ``ast``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "xtl"
# Lowest first: a package may import its own layer and the ones below.
LAYERS = (
    ("xtl", "errors", "utils", "batch", "_quiet"),
    ("ops",),
    ("module",),
    ("model", "data"),
    ("strategies",),
    ("train", "rl"),
    ("callbacks",),
    ("cli_parser", "moved_settings", "run_layout"),
    ("cli",),
    ("tools",),
    ("command", "__main__"),
)
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """``module -> the xtl modules it imports`` (with ``type_checking``, also those imported for annotations only)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hidden = {
            id(node)
            for block in ast.walk(tree)
            if not type_checking and isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name] |= {t for t in targets if t in modules}
    return graph


def package(module: str) -> str:
    """``xtl.model.dense.dense`` -> ``model``; ``xtl`` -> ``xtl``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


class TestImportGraph:
    def test_every_package_has_a_layer(self):
        assert {package(m) for m in import_graph()} <= set(LAYER)

    def test_no_package_imports_a_higher_layer(self):
        upward = sorted(
            f"{module} -> {target}"
            for module, targets in import_graph().items()
            for target in targets
            if LAYER[package(target)] > LAYER[package(module)]
        )
        assert upward == []

    def test_no_cycles(self):
        graph = import_graph()
        cycles = []
        for start in graph:
            path, stack = [start], [iter(graph[start])]
            while stack:  # depth-first from start, looking for a way back to it
                target = next(stack[-1], None)
                if target is None:
                    stack.pop()
                    path.pop()
                elif target == start:
                    cycles.append(" -> ".join([*path, start]))
                    break
                elif target not in path and len(path) < 12:
                    path.append(target)
                    stack.append(iter(graph[target]))
        assert cycles == []

    def test_annotation_imports_close_no_cycle_but_a_config_and_its_model(self):
        """With the ``TYPE_CHECKING`` imports too, modules that reach each other are only a config and the model
        its ``build()`` returns (``xtl.model.config`` and ``xtl.model.base``, a family's config and body). The
        checkpoint I/O names the model it loads through a protocol of its own, not the model base."""
        graph = import_graph(type_checking=True)
        reach = {module: _reachable(graph, module) for module in graph}
        groups = {frozenset(m for m in reach[module] if module in reach[m]) | {module} for module in graph}
        tangled = [sorted(g) for g in groups if len(g) > 1]
        assert [g for g in tangled if len(g) != 2 or not any(m.endswith(".config") for m in g)] == []
        assert ["xtl.model.base", "xtl.model.config"] in tangled  # the exception is real: the test can see one

    @pytest.mark.parametrize("layer", range(len(LAYERS)))
    def test_the_layers_are_disjoint(self, layer):
        assert not set(LAYERS[layer]) & {n for i, names in enumerate(LAYERS) if i != layer for n in names}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def probes(root: Path, packages: tuple[str, ...]) -> list[str]:
    """``file:line call`` for each attribute probe by a literal name (``getattr(m, "layers")``, ``hasattr(m, "x")``)
    and each ``isinstance(..., <...Strategy>)`` branch in the ``packages`` under ``root``."""
    found = []
    for name in packages:
        for path in sorted((root / name).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or len(node.args) < 2:
                    continue
                call, second = node.func.id, node.args[1]
                literal = isinstance(second, ast.Constant) and isinstance(second.value, str)
                strategy = call == "isinstance" and "Strategy" in ast.unparse(second)
                if (call in ("getattr", "hasattr") and literal) or strategy:
                    found.append((str(path.relative_to(root)), node.lineno, ast.unparse(node)))
    return [f"{path}:{line} {call}" for path, line, call in sorted(found)]


class TestSeams:
    """Transforms and strategies reach the model through its typed parts (``decoder_layers()``, ``moe_blocks()``,
    ...) and the strategy through its hooks: no probing by attribute name, no branch on the strategy class."""

    def test_no_probes_in_callbacks_and_strategies(self):
        assert probes(PACKAGE, ("callbacks", "strategies")) == []

    def test_the_scan_finds_a_probe(self, tmp_path):
        (tmp_path / "callbacks").mkdir()
        (tmp_path / "callbacks/bad.py").write_text(
            "def f(model, strategy):\n    if isinstance(strategy, FSDPStrategy):\n"
            "        return getattr(model, 'layers')\n    return hasattr(model.mlp, 'experts')\n"
        )
        assert [p.split(" ", 1)[0] for p in probes(tmp_path, ("callbacks",))] == [
            "callbacks/bad.py:2", "callbacks/bad.py:3", "callbacks/bad.py:4",
        ]  # fmt: skip

    def test_a_family_that_does_not_name_its_decoder_layers_cannot_be_built(self):
        from xtl.model import BaseModel

        class NoLayers(BaseModel):
            def forward(self, *args, **kwargs):
                return None

        with pytest.raises(TypeError, match="decoder_layers"):
            NoLayers(None)
