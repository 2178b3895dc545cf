"""Tools an agent loop lets the model call, and how each call runs.

A tool is a Python callable with a Google-style docstring (its JSON schema is derived from the signature and the
docstring by :func:`transformers.utils.get_json_schema`, the format TRL's ``tools`` and the chat templates use) or
an explicit OpenAI function schema with the import path of the function that answers it. In YAML a tool is an import
path (``xtl.rl.agent.calculator``) or a mapping (``function``, optional ``schema``, ``timeout_s``, ``subprocess``,
``memory_mb``).

Every call runs under a time-out. An in-process tool runs on a thread of its own: a call that does not answer in time
gives the model a time-out error (the thread cannot be stopped and is left behind; give tools that may hang
``subprocess: true``). A
``subprocess`` tool runs in a fresh Python process with a memory and CPU-time limit and is killed at its time-out:
code-executing tools (:func:`python`) run that way. Whatever a call does (raise, hang, return an unknown type), the
model gets a tool turn with the error, never the run.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xtl.errors import ConfigError

KEY = "model.init_args.agent.init_args.tools"


@dataclass
class ToolResult:
    """What one call returned.

    Attributes:
        content: The text the model reads in the tool turn.
        status: ``ok``, ``error`` (it raised, or its arguments were wrong), ``timeout``.
    """

    content: str
    status: str = "ok"


@dataclass
class Tool:
    """One callable tool.

    Args:
        function: The callable, or its import path (``package.module.name`` or ``package.module:name``).
        schema: Its OpenAI function schema (``{"type": "function", "function": {"name", "description",
            "parameters"}}``); ``None``: derived from the callable's signature and Google docstring.
        timeout_s: Seconds a call may take.
        subprocess: Run each call in a fresh Python process (limited, killed at the time-out); the function must
            then be importable by path.
        memory_mb: Address-space limit of a subprocess call.
        ray: Run each call as a Ray task (``pip install ray``; the running cluster, or a local one), cancelled at
            the time-out: tools that need other machines or resources (``ray_options``: ``num_cpus``, ...).
        ray_options: Ray task options.

    Raises:
        ConfigError: The function cannot be imported, its schema cannot be derived, a limit is not positive.
    """

    function: Callable[..., Any] | str
    schema: dict[str, Any] | None = None
    timeout_s: float = 10.0
    subprocess: bool = False
    memory_mb: int = 1024
    ray: bool = False
    ray_options: dict[str, Any] = field(default_factory=dict)
    path: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if isinstance(self.function, str):
            self.path = self.function
            self.function = import_callable(self.function)
        else:
            self.path = f"{self.function.__module__}:{self.function.__qualname__}"
        if self.subprocess and self.ray:
            raise ConfigError(f"{KEY}: tool {self.path}: subprocess and ray are two ways to run it; choose one")
        if self.timeout_s <= 0 or self.memory_mb <= 0:
            raise ConfigError(f"{KEY}: tool {self.path}: timeout_s and memory_mb must be > 0")
        if self.schema is None:
            from transformers.utils import get_json_schema

            try:
                self.schema = get_json_schema(self.function)
            except Exception as err:  # transformers raises its own its docstring and type-hint parsing errors
                raise ConfigError(
                    f"{KEY}: cannot derive the schema of {self.path} ({err}); give it type hints and a Google "
                    "docstring with an Args section, or a schema"
                ) from None
        if "function" not in self.schema or "name" not in self.schema["function"]:
            raise ConfigError(f"{KEY}: tool {self.path}: schema needs {{'type': 'function', 'function': {{'name'}}}}")

    @property
    def name(self) -> str:
        """The name the model calls it by."""
        return str(self.schema["function"]["name"])

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run the tool on ``arguments`` under its time-out; errors come back as the result's text."""
        if self.subprocess:
            return self._call_in_subprocess(arguments)
        if self.ray:
            return self._call_on_ray(arguments)
        done: list[ToolResult] = []

        def run() -> None:
            try:
                done.append(ToolResult(_as_text(self.function(**arguments))))
            except Exception as err:  # the model's call raised: it reads the error, the run goes on
                done.append(ToolResult(f"Error: {type(err).__name__}: {err}", "error"))

        thread = threading.Thread(target=run, name=f"xtl-tool-{self.name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not done:  # a daemon thread that never returns is left behind; it blocks nothing else
            return ToolResult(f"Error: {self.name} timed out after {self.timeout_s:g} s", "timeout")
        return done[0]

    def _call_on_ray(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            import ray
        except ImportError as err:
            raise ImportError("tools with ray: true need Ray: pip install ray") from err
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=False)
        ref = ray.remote(self.function).options(**self.ray_options).remote(**arguments)
        try:
            return ToolResult(_as_text(ray.get(ref, timeout=self.timeout_s)))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            return ToolResult(f"Error: {self.name} timed out after {self.timeout_s:g} s", "timeout")
        except ray.exceptions.RayTaskError as err:  # the tool raised on its worker
            cause = err.cause if err.cause is not None else err
            return ToolResult(f"Error: {type(cause).__name__}: {cause}", "error")

    def _call_in_subprocess(self, arguments: dict[str, Any]) -> ToolResult:
        payload = json.dumps({"path": self.path, "arguments": arguments})
        limit = self.memory_mb * 1024 * 1024
        cpu = max(1, math.ceil(self.timeout_s))

        def limits() -> None:  # in the child, before it runs Python
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD], input=payload, capture_output=True, text=True,
                timeout=self.timeout_s, preexec_fn=limits if os.name == "posix" else None,
            )  # fmt: skip
        except subprocess.TimeoutExpired:  # run() kills the child
            return ToolResult(f"Error: {self.name} timed out after {self.timeout_s:g} s", "timeout")
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            return ToolResult(f"Error: {tail}", "error")
        try:
            out = json.loads(done.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return ToolResult(f"Error: {self.name} printed no result", "error")
        return ToolResult(out["content"], out["status"])


def as_tools(tools: list[Tool | Callable[..., Any] | str | dict[str, Any]] | None) -> list[Tool]:
    """``tools`` as :class:`Tool` s (callables, import paths and mappings accepted), names unique.

    Raises:
        ConfigError: An entry of another type, two tools of one name.
    """
    out = []
    for i, tool in enumerate(tools or []):
        if isinstance(tool, Tool):
            out.append(tool)
        elif isinstance(tool, dict):
            try:
                out.append(Tool(**tool))
            except TypeError as err:
                raise ConfigError(f"{KEY}[{i}]: {err}") from None
        elif isinstance(tool, str) or callable(tool):
            out.append(Tool(tool))
        else:
            raise ConfigError(f"{KEY}[{i}]: a tool is an import path, a callable or a mapping, got {tool!r}")
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{KEY}: two tools are named {next(n for n in names if names.count(n) > 1)!r}")
    return out


def import_callable(path: str, key: str = KEY) -> Callable[..., Any]:
    """The callable at ``package.module.name`` or ``package.module:name`` (``key``: the YAML key it was given at).

    Raises:
        ConfigError: It cannot be imported or is not callable.
    """
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{key}: cannot import {path!r} ({err})") from None
    if not callable(value):
        raise ConfigError(f"{key}: {path!r} is not callable")
    return value


# ---- private ---------------------------------------------------------------------------------------------------

# the subprocess's program: it imports only the tool's own module (not xtl.rl, which takes seconds)
_CHILD = """
import importlib, json, sys
request = json.loads(sys.stdin.read())
path = request["path"]
module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
try:
    value = getattr(importlib.import_module(module), name)(**request["arguments"])
    if not isinstance(value, str):
        try:
            value = json.dumps(value)
        except TypeError:
            value = str(value)
    out = {"content": value, "status": "ok"}
except Exception as err:
    out = {"content": f"Error: {type(err).__name__}: {err}", "status": "error"}
sys.stdout.write("\\n" + json.dumps(out) + "\\n")
"""


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)
