"""Operational tools exposed as ``xtl <name>`` sub-commands.

``TOOLS`` maps a sub-command name to its ``main(argv) -> exit code``. Each tool module is imported only when its
sub-command runs, so ``xtl --help`` stays fast and a tool's heavy imports (torch, transformers) are paid on use.

Exit codes shared by every tool: 0 ok, 1 check failed / differences found, 2 usage or input error.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["TOOLS", "tool_main"]

_MODULES = {
    "memory": "xtl.tools.memory",
    "convert": "xtl.tools.convert",
    "check-hf-config": "xtl.tools.check_hf_config",
    "generate": "xtl.tools.generate",
    "check-parity": "xtl.tools.check_parity",
    "eval": "xtl.tools.eval",
    "build-cache": "xtl.tools.build_cache",
}


def tool_main(name: str) -> Callable[[list[str] | None], int]:
    """Return the entry point of tool ``name`` that imports its module on first call.

    Args:
        name (str): Sub-command name, one of ``TOOLS``.

    Returns:
        Callable[[list[str] | None], int]: ``main(argv) -> exit code``.
    """
    module_name = _MODULES[name]

    def main(argv: list[str] | None = None) -> int:
        return importlib.import_module(module_name).main(argv)

    main.__name__ = f"{name.replace('-', '_')}_main"
    main.__doc__ = f"Run ``xtl {name}`` (see ``{module_name}``)."
    return main


TOOLS: dict[str, Callable[[list[str] | None], int]] = {name: tool_main(name) for name in _MODULES}
