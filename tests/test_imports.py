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
    ("xtl", "errors", "utils", "batch", "_quiet", "agent_tools"),
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


# ---- seams ------------------------------------------------------------------------------------------------------

# Third-party objects whose optional attributes xtl may probe, one entry per probe: "file: expression -> reason".
SEAM_ALLOWLIST = (
    "callbacks/watchdog.py: hasattr(distributed_c10d, '_get_default_store') -> torch's private getter of the default"
    " process group's store (no public API; checked, so that another torch turns the watchdog off with a message)",
    "cli_parser.py: getattr(action, 'choices', None) -> an argparse action of jsonargparse's: only some have choices",
    "cli_parser.py: getattr(module, '__all__', None) -> any Python module a class_path names: only some declare"
    " __all__ (the suggestion then lists its public names)",
    "cli_parser.py: getattr(package, '__all__', None) -> a package on a class's module path: only some re-export"
    " names (the suggestion shows the shortest path)",
    "data/tokenize.py: getattr(tokenizer, 'backend_tokenizer', None) -> a transformers tokenizer: only fast ones"
    " have a Rust backend",
    "model/compose/config.py: getattr(hf_config.text_config, 'tie_word_embeddings', None) -> a transformers text"
    " config may leave the field out",
    "model/parity/reference.py: getattr(config, 'layer_types', None) -> a transformers config's optional"
    " per-layer list",
    "module/nf4.py: hasattr(fsdp_param, attr) -> torch's private FSDPParam methods that QLoRA under FSDP calls"
    " (checked, so that another torch fails with a message)",
    "module/rope.py: getattr(hf_config, 'head_dim', None) -> a transformers config's optional field",
    "ops/grouped_gemm.py: hasattr(torch, '_grouped_mm') -> a torch build may lack the grouped GEMM",
    "train/reference_cache.py: getattr(obj, '__qualname__', repr(obj)) -> hashed code: any Python object",
    "train/step.py: getattr(inner, '_step_supports_amp_scaling', False) -> torch's flag of optimizers with a fused"
    " found-inf path (no public API)",
)
_MODULE_ITERATORS = ("named_modules", "named_children")


def seam_findings(root: Path) -> list[tuple[str, int, str, str]]:
    """``(file, line, kind, expression)`` for each recognition by name in the ``.py`` files under ``root``.

    Kinds (see :class:`TestSeams`): ``probe`` (``getattr``/``hasattr`` with a literal name, an f-string or a name
    looped over literals), ``strategy`` (``isinstance`` on a strategy class other than the ``ParallelizingStrategy``
    protocol), ``type name`` / ``module name`` / ``family name`` (a comparison, ``in`` test or
    ``startswith``/``endswith`` against a literal of ``type(x).__name__``, of a module name's last dotted part or
    of a module name from ``named_modules()``, of ``family.name`` or ``model_type``; directly or through a
    variable), ``model part`` (an attribute of a name annotated ``BaseModel`` that ``BaseModel`` does not declare,
    or a private one).
    """
    from xtl.model.base import BaseModel

    declared = set(dir(BaseModel)).union(*(vars(c).get("__annotations__", {}) for c in BaseModel.__mro__))
    found = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for scope in _scopes(tree):
            names = _ScopeNames(scope)
            for node in ast.walk(scope):
                kind = _finding(node, names, declared)
                if kind:
                    found.add((path.relative_to(root).as_posix(), node.lineno, kind, ast.unparse(node)))
    return sorted(found)


def _scopes(tree: ast.Module) -> list[ast.AST]:
    """The module-level statements, and each function that no other function holds (with what it nests)."""
    scopes: list[ast.AST] = [ast.Module([n for n in tree.body if not isinstance(n, _DEFS)], [])]
    todo = [n for n in tree.body if isinstance(n, _DEFS)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ClassDef):
            todo += [n for n in node.body if isinstance(n, _DEFS)]
            scopes.append(ast.Module([n for n in node.body if not isinstance(n, _DEFS)], []))
        else:
            scopes.append(node)
    return scopes


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class _ScopeNames:
    """What the names of one scope hold: a literal attribute name (looped over), a name (``type name``, ``module
    name``, ``family name``), or a ``BaseModel``."""

    def __init__(self, scope: ast.AST) -> None:
        self.kinds: dict[str, str] = {}
        self.models: set[str] = set()
        for node in ast.walk(scope):
            if isinstance(node, (ast.For, ast.comprehension)):
                targets = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
                if _literal(node.iter):
                    self.kinds.update(dict.fromkeys(_names(node.target), "literal"))
                elif _call_of(node.iter, _MODULE_ITERATORS):
                    self.kinds.update(dict.fromkeys(_names(targets[0]), "module name"))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    self._bind(target, node.value)
            annotated = isinstance(node, ast.arg) or (isinstance(node, ast.AnnAssign) and _is_name(node.target))
            if annotated and node.annotation is not None and "BaseModel" in ast.unparse(node.annotation):
                self.models.add(node.arg if isinstance(node, ast.arg) else node.target.id)

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Tuple) and _call_of(value, ("rpartition",)) and _dotted(value):  # _, _, last = ...
            self.kinds.update(dict.fromkeys(_names(target.elts[-1]), "module name"))
        elif kind := self.kind(value):
            self.kinds.update(dict.fromkeys(_names(target), kind))

    def kind(self, node: ast.AST) -> str | None:
        """What name ``node`` holds, if any: ``type name``, ``module name`` or ``family name``."""
        for sub in ast.walk(node):
            attr = sub.attr if isinstance(sub, ast.Attribute) else ""
            if attr in ("__name__", "__qualname__") and (
                _call_of(sub.value, ("type",)) or getattr(sub.value, "attr", "") == "__class__"
            ):
                return "type name"
            if _last_part(sub):
                return "module name"
            if attr == "model_type" or (attr == "name" and ast.unparse(sub.value).endswith("family")):
                return "family name"
            if _is_name(sub) and self.kinds.get(sub.id, "literal") != "literal":
                return self.kinds[sub.id]
        return None


def _finding(node: ast.AST, names: _ScopeNames, declared: set[str]) -> str | None:
    if isinstance(node, ast.Call) and _is_name(node.func) and len(node.args) >= 2:
        call, owner, name = node.func.id, node.args[0], node.args[1]
        looped = _is_name(name) and names.kinds.get(name.id) == "literal"
        own_field = call == "getattr" and len(node.args) == 2 and _is_name(owner) and owner.id == "self"
        if call in ("getattr", "hasattr") and (_literal(name) or (looped and not own_field)):
            return "probe"
        if call == "isinstance" and "Strategy" in ast.unparse(name) and ast.unparse(name) != "ParallelizingStrategy":
            return "strategy"
    if isinstance(node, ast.Compare) and any(_literal(x) for x in [node.left, *node.comparators]):
        return next(filter(None, map(names.kind, [node.left, *node.comparators])), None)
    if _call_of(node, ("startswith", "endswith")) and node.args and _literal(node.args[0]):
        return names.kind(node.func.value)
    if isinstance(node, ast.Attribute) and _is_name(node.value) and node.value.id in names.models:
        return "model part" if node.attr.startswith("_") or node.attr not in declared else None
    return None


def _literal(node: ast.AST) -> bool:
    """A string literal, an f-string, or a tuple/list/set of string literals."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(map(_literal, node.elts))
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _last_part(node: ast.AST) -> bool:
    """``name.rsplit(".", 1)[-1]``, ``name.split(".")[-1]``, ``name.rpartition(".")[2]``: a dotted name's last part."""
    if not isinstance(node, ast.Subscript) or not _call_of(node.value, ("split", "rsplit", "rpartition")):
        return False
    index = ast.unparse(node.slice)
    return _dotted(node.value) and (index == "-1" or (index == "2" and node.value.func.attr == "rpartition"))


def _dotted(call: ast.Call) -> bool:
    return bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value == "."


def _call_of(node: ast.AST, functions: tuple[str, ...]) -> bool:
    """A call of one of ``functions`` (a plain function or a method)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in functions


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Name)


def _names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _allowed() -> dict[tuple[str, str], str]:
    entries = [entry.split(" -> ", 1) for entry in SEAM_ALLOWLIST]
    return {tuple(where.split(": ", 1)): reason for where, reason in entries}


class TestSeams:
    """Every part of a model, trait of a config or module, and role of an object is reached through its declared
    type (``decoder_layers()``, ``text_model().lm_head``, ``config.mtp_layers``, ``isinstance(m, KeepsFp32)``,
    ``family.vision``, ...): nothing in ``xtl`` probes for an attribute by name, branches on a strategy class or
    recognizes a module, a class or a family by its name. Probes of third-party objects' optional attributes are
    listed in :data:`SEAM_ALLOWLIST`, each with its reason."""

    def test_nothing_in_xtl_is_recognized_by_name(self):
        allowed = _allowed()
        found = [f"{file}:{line} [{kind}] {text}" for file, line, kind, text in seam_findings(PACKAGE)]
        assert [f for f in found if (f.split(":", 1)[0], f.split("] ", 1)[1]) not in allowed] == []

    def test_every_allowlist_entry_is_still_found(self):
        found = {(file, text) for file, _, _, text in seam_findings(PACKAGE)}
        assert [f"{file}: {text}" for file, text in _allowed() if (file, text) not in found] == []

    def test_the_scan_finds_each_kind_of_recognition_by_name(self, tmp_path):
        (tmp_path / "bad.py").write_text(
            "def f(model, strategy, config, stage):\n"
            "    if isinstance(strategy, FSDPStrategy):\n"  # a branch on the strategy class
            "        return getattr(model, 'layers')\n"
            "    depths = getattr(config, 'mtp_layers', 0) + hasattr(model.mlp, 'experts')\n"
            "    names = getattr(datamodule, f'{stage}_set_names', None)\n"
            "    return [n for n in ('embed_tokens', 'layers', 'norm') if not hasattr(model, n)]\n"  # parity engine
            "def g(model: BaseModel, name):\n"
            "    head = name.rsplit('.', 1)[-1] != 'lm_head'\n"  # the LM head by its name
            "    last = name.split('.')[-1]\n"
            "    _, _, child = name.rpartition('.')\n"
            "    return head, last == 'lm_head', child in ('lm_head', 'embed_tokens'), model._keep_fp32_names()\n"
            "def h(model: BaseModel):\n"
            "    heads = [m for n, m in model.named_modules() if n.endswith('.lm_head')]\n"
            "    return len(model.layers), model.norm, heads\n"  # parts BaseModel does not declare
            "def k(module, self):\n"
            "    kind = type(module).__name__\n"
            "    return ('norm' in type(module).__name__.lower(), kind.endswith('RMSNorm'),\n"  # norms by class name
            "            self.family.name.startswith('vision'), config.model_type == 'qwen3')\n"  # family by name
        )
        assert [f"{line} {kind}" for _, line, kind, _ in seam_findings(tmp_path)] == [
            "2 strategy", "3 probe", "4 probe", "4 probe", "5 probe", "6 probe",
            "8 module name", "11 model part", "11 module name", "11 module name",
            "13 module name", "14 model part", "14 model part",
            "17 type name", "17 type name", "18 family name", "18 family name",
        ]  # fmt: skip

    def test_the_scan_leaves_typed_code_alone(self, tmp_path):
        (tmp_path / "good.py").write_text(
            "def f(self, model: BaseModel, strategy, name, module):\n"
            "    if isinstance(strategy, ParallelizingStrategy):\n"  # the declared protocol
            "        return [getattr(self, key) for key in ('muon_params', 'adamw_params')]\n"  # its own fields
            "    package = name.split('.')[0]\n"
            "    head = model.text_model().lm_head\n"
            "    text = f'{type(module).__name__} has no part'\n"  # a message, not a test
            "    return package == 'xtl', module is head, model.decoder_layers(), model.config, text\n"
        )
        assert seam_findings(tmp_path) == []

    def test_a_family_that_does_not_name_its_decoder_layers_cannot_be_built(self):
        from xtl.model import BaseModel

        class NoLayers(BaseModel):
            def forward(self, *args, **kwargs):
                return None

        with pytest.raises(TypeError, match="decoder_layers"):
            NoLayers(None)
