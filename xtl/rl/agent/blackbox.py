"""Black-box agents: external programs that run their own loop against the trainer's OpenAI-compatible endpoint.

For each prompt, :class:`BlackBoxAgentLoop` opens a session on its :class:`~xtl.rl.agent.endpoint.SessionServer`
and starts one agent:

- ``command``: a subprocess (any program with an OpenAI client). It gets ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
  (its session key) in its environment, and the task as JSON on stdin and in ``XTL_AGENT_TASK``: ``{"messages":
  [...], "data_source": ...}`` and the row's other fields, never its reference answer. The last line it prints is its
  answer (the judger scores it; without one, the last reply's text).
- ``function``: a Python callable ``function(task, base_url, api_key) -> answer`` (or its import path), on a thread,
  or as a Ray task with ``ray: true`` (``pip install ray``).

While agents run, the trainer's thread samples their queued requests in batches (each engine call takes every
request that came within ``batch_wait_s``, or all live agents' once each has one in flight), and each session rebuilds
its trajectory token-exactly (:mod:`xtl.rl.agent.session`). An agent that exits with an error, is killed at
``timeout_s`` or never calls the endpoint aborts its own trajectory (the sample does not train), never the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

from xtl.errors import ConfigError
from xtl.rl import trace
from xtl.rl.agent.endpoint import SessionServer
from xtl.rl.agent.loop import AgentContext, AgentLoop
from xtl.rl.agent.tools import import_callable
from xtl.rl.agent.trajectory import Trajectory
from xtl.rl.rollout import RolloutEngine, SamplingSettings

KEY = "model.init_args.agent.init_args"


class BlackBoxAgentLoop(AgentLoop):
    """Rollouts by external agents through the endpoint (module docstring).

    Args:
        command: The agent program and its arguments (a list, or one string split on spaces).
        function: Instead of ``command``: a callable ``(task, base_url, api_key) -> answer`` or its import path.
        ray: Run ``function`` as a Ray task (``pip install ray``) instead of on a thread.
        max_concurrency: Agents running at once at most.
        timeout_s: Seconds an agent may run (a subprocess is killed then).
        batch_wait_s: How long a queued request waits for the other live agents' requests to share its engine call
            (the call starts at once when every live agent has one queued).
        env: Extra environment variables of ``command`` agents.
        port: The endpoint's local port (0: a free one).

    Raises:
        ConfigError: Neither or both of ``command`` and ``function``; ``ray`` without ``function``; limits below 1.
    """

    image_refusal = (
        "an external agent's requests reach the endpoint as messages whose images the endpoint does not serve yet "
        "(its sessions pass token ids only to the engine)"
    )

    def __init__(
        self,
        command: list[str] | str | None = None,
        function: Callable[..., Any] | str | None = None,
        ray: bool = False,
        max_concurrency: int = 64,
        timeout_s: float = 300.0,
        batch_wait_s: float = 0.05,
        env: dict[str, str] | None = None,
        port: int = 0,
    ) -> None:
        if (command is None) == (function is None):
            raise ConfigError(f"{KEY}: give the agent as a command or as a function (one of them)")
        if ray and function is None:
            raise ConfigError(f"{KEY}.ray runs a function as a Ray task: give function, not command")
        if max_concurrency < 1 or timeout_s <= 0 or batch_wait_s < 0:
            raise ConfigError(f"{KEY}: max_concurrency must be >= 1, timeout_s > 0 and batch_wait_s >= 0")
        self.command = command.split() if isinstance(command, str) else command
        named = function if isinstance(function, str) else repr(function)
        self.name = " ".join(self.command) if self.command else named
        if isinstance(function, str):
            function = import_callable(function, f"{KEY}.function")
        self.function = function
        self.ray = ray
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.batch_wait_s = batch_wait_s
        self.env = dict(env or {})
        self.port = port
        self.server: SessionServer | None = None
        self._round = 0

    def describe(self) -> str:
        """The agent and its limits."""
        return f"black-box agents ({self.name}; {self.max_concurrency} at once, {self.timeout_s:g} s each)"

    def rollout(
        self, rows: list[dict[str, Any]], engine: RolloutEngine, sampling: SamplingSettings, context: AgentContext
    ) -> list[Trajectory]:
        """Run one agent per row to its end, serving their requests from ``engine``."""
        if self.server is None or self.server.chat is not context.chat:
            self.close()
            self.server = SessionServer(context.chat, port=self.port)
        server, stop = self.server, context.chat.stop_token_ids
        self._round += 1
        waiting = deque(enumerate(rows))
        running: dict[int, _Agent] = {}
        out: list[Trajectory | None] = [None] * len(rows)
        while True:
            while waiting and len(running) < self.max_concurrency:
                i, row = waiting.popleft()
                key = f"xtl-{os.getpid()}-{self._round}-{i}"
                running[i] = self._start(server.open(key), row)
            for i, agent in list(running.items()):
                if agent.finished(self.timeout_s):
                    out[i] = agent.trajectory()
                    server.close(agent.session.key)
                    del running[i]
            live = lambda: sum(agent.alive() for agent in running.values())  # noqa: E731
            batch = server.take(live, max(self.batch_wait_s, 0.005)) if running else []
            prompts = [r.prompt_ids for r in batch]
            wanted = context.agree(len(prompts)) if context.agree is not None else len(prompts)
            if wanted:
                if prompts:
                    rows_of = {agent.session.key: i for i, agent in running.items()}
                    ids = context.ids([rows_of[r.session.key] for r in batch if r.session.key in rows_of])
                    with trace.current().span("engine.generate", "generate", ids, requests=len(prompts)):
                        rollouts = engine.generate(prompts, sampling, stop)
                    for request, rollout in zip(batch, rollouts, strict=True):
                        server.answer(request, rollout)
                else:
                    engine.idle_step(sampling, stop)
                continue
            more = int(bool(running or waiting))
            if not (context.agree(more) if context.agree is not None else more):
                break
        return [t for t in out if t is not None]

    def close(self) -> None:
        """Stop the endpoint."""
        if self.server is not None:
            self.server.shutdown()
            self.server = None

    def _start(self, session: Any, row: dict[str, Any]) -> _Agent:
        task = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        task["messages"] = row["prompt"]
        base_url = self.server.base_url
        if self.command is not None:
            return _ProcessAgent(session, task, base_url, self.command, self.env)
        if self.ray:
            return _RayAgent(session, task, base_url, self.function)
        return _ThreadAgent(session, task, base_url, self.function)


# ---- private ---------------------------------------------------------------------------------------------------


class _Agent(ABC):
    """One running agent and its session (a process, a thread or a Ray task below)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.began = time.monotonic()
        self.answer: str | None = None
        self.error: str | None = None

    def finished(self, timeout_s: float) -> bool:
        """Whether it has ended (stopping it when it ran past ``timeout_s``)."""
        if self._poll():
            return True
        if time.monotonic() - self.began > timeout_s:
            self._stop()
            self.error = f"the agent ran past its {timeout_s:g} s time-out"
            return True
        return False

    def trajectory(self) -> Trajectory:
        return self.session.trajectory(self.answer, self.error)

    @abstractmethod
    def alive(self) -> bool:
        """Whether it may still send a request."""

    @abstractmethod
    def _poll(self) -> bool:
        """Whether it has ended (recording its answer or error then)."""

    def _stop(self) -> None:  # noqa: B027 (a thread cannot be stopped: only processes and Ray tasks override it)
        """Stop it at its time-out."""


class _ProcessAgent(_Agent):
    def __init__(
        self, session: Any, task: dict[str, Any], base_url: str, command: list[str], env: dict[str, str]
    ) -> None:
        super().__init__(session)
        payload = json.dumps(task)
        environment = {**os.environ, **env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": session.key,
                       "XTL_AGENT_TASK": payload}  # fmt: skip
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=self.out, stderr=self.err, env=environment, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            self.process.stdin.write(payload)
            self.process.stdin.close()
        except OSError:  # it exited before reading: its exit code says why
            pass

    def alive(self) -> bool:
        return self.process.poll() is None

    def _poll(self) -> bool:
        code = self.process.poll()
        if code is None:
            return False
        self.out.seek(0)
        self.err.seek(0)
        lines = [line.strip() for line in self.out.read().splitlines() if line.strip()]
        if code != 0:
            tail = (self.err.read().strip().splitlines() or [""])[-1]
            self.error = f"the agent exited with code {code}" + (f": {tail}" if tail else "")
        self.answer = lines[-1] if lines else None
        self.out.close()
        self.err.close()
        return True

    def _stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.out.close()
        self.err.close()


class _ThreadAgent(_Agent):
    def __init__(self, session: Any, task: dict[str, Any], base_url: str, function: Callable[..., Any]) -> None:
        super().__init__(session)
        self.result: list[Any] = []

        def run() -> None:
            try:
                self.result.append(("ok", function(task, base_url, session.key)))
            except Exception as err:  # the agent's failure costs its own trajectory
                self.result.append(("error", f"the agent raised {type(err).__name__}: {err}"))

        self.thread = threading.Thread(target=run, name=f"xtl-agent-{session.key}", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return not self.result

    def _poll(self) -> bool:
        if not self.result:
            return False
        status, value = self.result[0]
        if status == "ok":
            self.answer = None if value is None else str(value)
        else:
            self.error = value
        return True


class _RayAgent(_Agent):
    def __init__(self, session: Any, task: dict[str, Any], base_url: str, function: Callable[..., Any]) -> None:
        super().__init__(session)
        try:
            import ray
        except ImportError as err:
            raise ImportError("ray agents need Ray: pip install ray") from err
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=False)
        self.ray = ray
        self.ref = ray.remote(function).remote(task, base_url, session.key)

    def alive(self) -> bool:
        return not self.ray.wait([self.ref], timeout=0)[0]

    def _poll(self) -> bool:
        ready, _ = self.ray.wait([self.ref], timeout=0)
        if not ready:
            return False
        try:
            value = self.ray.get(self.ref)
            self.answer = None if value is None else str(value)
        except Exception as err:  # RayTaskError wraps the agent's own exception
            self.error = f"the agent raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return True

    def _stop(self) -> None:
        self.ray.cancel(self.ref, force=True)
