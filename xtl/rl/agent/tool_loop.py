"""The multi-turn tool loop: the model calls tools, reads their results and answers.

Each turn samples every unfinished trajectory's next assistant turn in one engine call. A turn's tool calls (in the
template's syntax, :mod:`xtl.rl.agent.chat`) run concurrently, each under its tool's time-out
(:mod:`xtl.rl.agent.tools`); their results are appended as tool turns (loss mask 0) followed by the next generation
prompt. A trajectory ends when a turn calls no tool (``stop``: that turn's text is the answer), or when a budget runs
out (``length``): a turn cut at ``sampling.max_new_tokens``, ``max_turns`` assistant turns, or ``max_tokens``
response tokens in all.

What goes wrong costs at most a tool turn: a call that cannot be parsed, names an unknown tool, has wrong arguments,
raises or times out gets a tool turn with the error (``Error: ...``), and the model may try again. Calls beyond
``max_tool_calls`` are refused the same way. Each trajectory counts its ``tool_calls``, ``tool_errors``,
``tool_timeouts``, ``malformed_calls`` and ``refused_calls`` (logged as ``rollout/...``).
"""

from __future__ import annotations

import threading
from typing import Any

from xtl.errors import ConfigError
from xtl.rl import trace
from xtl.rl.agent.chat import ChatFormat, ParsedTurn
from xtl.rl.agent.loop import AgentContext, AgentLoop, lockstep_generate
from xtl.rl.agent.tools import Tool, ToolResult, as_tools
from xtl.rl.agent.trajectory import Trajectory, TrajectoryBuilder
from xtl.rl.rollout import RolloutEngine, SamplingSettings

KEY = "model.init_args.agent.init_args"


class ToolLoop(AgentLoop):
    """Multi-turn rollouts with tools (module docstring).

    Args:
        tools: The tools: callables with Google docstrings, import paths (``xtl.agent_tools.calculator``), or
            mappings (``function``, ``schema``, ``timeout_s``, ``subprocess``, ``memory_mb``; see
            :class:`~xtl.rl.agent.tools.Tool`). Their schemas are rendered by the chat template.
        max_turns: Assistant turns per trajectory at most.
        max_tool_calls: Tool calls per trajectory at most (later ones get a refusal).
        max_tokens: Response tokens per trajectory (sampled and appended) after which it stops.

    Raises:
        ConfigError: No tools, a budget below 1, or a tool that cannot be loaded.
    """

    def __init__(
        self,
        tools: list[Any],
        max_turns: int = 4,
        max_tool_calls: int = 8,
        max_tokens: int = 1024,
    ) -> None:
        self.tools = {tool.name: tool for tool in as_tools(tools)}
        if not self.tools:
            raise ConfigError(f"{KEY}.tools: a tool loop needs at least one tool")
        for name, value in (("max_turns", max_turns), ("max_tool_calls", max_tool_calls), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or value < 1:
                raise ConfigError(f"{KEY}.{name} must be >= 1, got {value!r}")
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.max_tokens = max_tokens

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, as the template renders them."""
        return [tool.schema for tool in self.tools.values()]

    def describe(self) -> str:
        """The tools and budgets."""
        return (
            f"tool loop ({', '.join(self.tools)}; at most {self.max_turns} turns, {self.max_tool_calls} calls, "
            f"{self.max_tokens} tokens)"
        )

    def rollout(
        self, rows: list[dict[str, Any]], engine: RolloutEngine, sampling: SamplingSettings, context: AgentContext
    ) -> list[Trajectory]:
        """Run every row's conversation to its end, one engine call per turn."""
        chat = context.chat
        live = [_Conversation(row, chat, self.schemas) for row in rows]
        done: list[Trajectory | None] = [None] * len(rows)
        while True:
            active = [i for i, c in enumerate(live) if done[i] is None]
            prompts = [live[i].builder.context_ids for i in active]
            rollouts = lockstep_generate(engine, prompts, sampling, context, active)
            if rollouts is None:
                break
            pending: list[tuple[int, dict[str, Any]]] = []  # (conversation, call) of this turn
            for i, rollout in zip(active, rollouts, strict=True):
                conv = live[i]
                conv.seconds += rollout.seconds
                conv.builder.sampled(rollout.response_ids, rollout.logprobs)
                conv.turns += 1
                parsed = chat.parse(rollout.response_ids)
                conv.last = parsed
                conv.messages.append(parsed.message())
                if rollout.finish_reason == "abort":
                    done[i] = conv.finish("abort", "the engine aborted the turn")
                elif rollout.finish_reason == "length" or conv.builder.response_tokens >= self.max_tokens:
                    done[i] = conv.finish("length")
                elif parsed.error is None and not parsed.calls:
                    done[i] = conv.finish("stop")
                elif conv.turns >= self.max_turns:
                    done[i] = conv.finish("length")
                else:
                    pending += [(i, call) for call in self._number(conv, parsed)]
            results = self._run_calls(live, pending, context)
            for i in sorted({i for i, _ in pending} | {i for i in active if done[i] is None and live[i].last.error}):
                conv = live[i]
                if conv.last.error is not None:
                    conv.builder.count("malformed_calls")
                    conv.messages.append(_tool_message(f"Error: malformed tool call: {conv.last.error}", None))
                    conv.statuses.append(("malformed", "malformed"))
                for (j, call), result in zip(pending, results, strict=True):
                    if j == i:
                        conv.messages.append(_tool_message(result.content, call["id"]))
                        conv.statuses.append((call["function"]["name"], result.status))
                if not conv.append_tool_turns():
                    done[i] = conv.finish("abort", "the template cannot continue this conversation")
                elif conv.builder.response_tokens >= self.max_tokens:
                    done[i] = conv.finish("length")
        return [t if t is not None else live[i].finish("abort", "no turn was sampled") for i, t in enumerate(done)]

    def _number(self, conv: _Conversation, parsed: ParsedTurn) -> list[dict[str, Any]]:
        """Give the turn's calls trajectory-wide ids; the ones over ``max_tool_calls`` are refused."""
        allowed = []
        for call in parsed.calls:
            call["id"] = f"call_{conv.calls}"
            conv.calls += 1
            if conv.calls > self.max_tool_calls:
                call["refused"] = True
            allowed.append(call)
        return allowed

    def _run_calls(
        self, live: list[_Conversation], pending: list[tuple[int, dict[str, Any]]], context: AgentContext
    ) -> list[ToolResult]:
        """Run the turn's calls concurrently (each under its own time-out) and count them."""
        results: list[ToolResult | None] = [None] * len(pending)
        tracer, parent = trace.current(), trace.carrier()

        def run(k: int, tool: Tool, arguments: dict[str, Any]) -> None:
            i, call = pending[k]
            name = call["function"]["name"]
            with tracer.span(f"tool.{name}", "tool", context.ids([i]), parent=parent, tool=name) as span:
                results[k] = tool.call(arguments)
                span.set(tool_status=results[k].status)

        threads = []
        for k, (i, call) in enumerate(pending):
            name = call["function"]["name"]
            builder = live[i].builder
            builder.count("tool_calls")
            if call.pop("refused", False):
                builder.count("refused_calls")
                results[k] = ToolResult(f"Error: the limit of {self.max_tool_calls} tool calls is reached", "refused")
            elif name not in self.tools:
                results[k] = ToolResult(f"Error: unknown tool {name!r}; tools: {', '.join(self.tools)}", "error")
            else:
                thread = threading.Thread(target=run, args=(k, self.tools[name], call["function"]["arguments"]))
                thread.start()
                threads.append(thread)
        for thread in threads:
            thread.join()
        out = [r if r is not None else ToolResult("Error: the tool returned nothing", "error") for r in results]
        for (i, _), result in zip(pending, out, strict=True):
            if result.status in ("error", "timeout"):
                live[i].builder.count("tool_errors" if result.status == "error" else "tool_timeouts")
        return out


# ---- private ---------------------------------------------------------------------------------------------------


class _Conversation:
    """One trajectory of the loop: its messages, builder and counters."""

    def __init__(self, row: dict[str, Any], chat: ChatFormat, schemas: list[dict[str, Any]]) -> None:
        self.chat, self.schemas = chat, schemas
        self.messages: list[dict[str, Any]] = [dict(m) for m in row["prompt"]]
        self.builder = TrajectoryBuilder(chat.prompt_ids(self.messages, schemas))
        self.turns = 0
        self.calls = 0
        self.seconds = 0.0
        self.last = ParsedTurn("")
        self.statuses: list[tuple[str, str]] = []  # (tool name, status) of the results waiting to be appended

    def append_tool_turns(self) -> bool:
        """Append the results (and the next generation prompt) as context; ``False`` when the template cannot."""
        ids = self.chat.continuation_ids(self.messages, self.schemas)
        if ids is None:
            return False
        statuses, self.statuses = self.statuses, []
        worst = next((s for _, s in statuses if s != "ok"), "ok")
        self.builder.appended(ids, "tool", ", ".join(f"{name}: {status}" for name, status in statuses), worst)
        return True

    def finish(self, reason: str, error: str | None = None) -> Trajectory:
        trajectory = self.builder.finish(reason, self.last.content, error)  # type: ignore[arg-type]
        trajectory.messages = self.messages
        trajectory.seconds = self.seconds
        trajectory.stats["turns"] = self.turns
        return trajectory


def _tool_message(content: str, call_id: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "tool", "content": content}
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message
