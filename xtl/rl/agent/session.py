"""A black-box agent's session: its requests recorded, its trajectory rebuilt token-exactly.

The agent sends whole conversations (OpenAI chat messages); the engine samples ids. A :class:`Session` keeps, for
each request, the prompt ids it was given and the ids the engine sampled, and builds the trajectory as it goes:

- the first request's prompt is the conversation rendered by the run's template;
- a request *extends* the recorded context when its messages are the previous request's messages, then the reply
  the session returned (compared as role, content and tool calls), then only non-assistant messages (tool results,
  user turns), with the same tools, after a reply that ended with the stop token. Its prompt is then the recorded
  ids followed by the template's continuation (:meth:`~xtl.rl.agent.chat.ChatFormat.continuation_ids`), appended as
  context (loss mask 0): the sampled ids are never re-encoded;
- any other request (the agent edited, dropped or summarized its history, changed its tools, or wrote an assistant
  turn itself) starts a new segment at its own rendering, and the trajectory's notes say which request did and why.
"""

from __future__ import annotations

import json
from typing import Any

from xtl.rl.agent.chat import ChatFormat, ParsedTurn
from xtl.rl.agent.trajectory import Trajectory, TrajectoryBuilder
from xtl.rl.rollout import Rollout


class Session:
    """The requests of one agent run and the trajectory they make.

    Args:
        key: The session's key (the agent's API key).
        chat: The run's chat format.
    """

    def __init__(self, key: str, chat: ChatFormat) -> None:
        self.key = key
        self.chat = chat
        self.builder: TrajectoryBuilder | None = None
        self.requests = 0
        self.seconds = 0.0
        self.answer = ""
        self.last_reason = "stop"
        self._messages: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._reply: dict[str, Any] | None = None
        self._calls = 0

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The prompt ids of a request (module docstring), recorded in the trajectory."""
        self.requests += 1
        why = self._why_not_extending(messages, tools)
        if self.builder is not None and why is None:
            ids = self.chat.continuation_ids(messages, tools)
            if ids is not None:
                kinds = {m["role"] for m in messages[len(self._messages) + 1 :]}
                self.builder.appended(ids, "tool" if kinds <= {"tool", "ipython"} else "context", ", ".join(kinds))
                return self._remember(messages, tools)
            why = "the template does not render it as a continuation"
        prompt = self.chat.prompt_ids(messages, tools)
        if self.builder is None:
            self.builder = TrajectoryBuilder(prompt)
        else:
            segment = len(self.builder.trajectory.segments)
            self.builder.new_segment(prompt, f"request {self.requests} starts segment {segment + 1}: {why}")
        return self._remember(messages, tools)

    def reply(self, rollout: Rollout) -> tuple[ParsedTurn, dict[str, Any]]:
        """Record the sampled ids of the current request; the parsed turn and the reply message to return."""
        assert self.builder is not None, "prompt() comes first"
        self.builder.sampled(rollout.response_ids, rollout.logprobs)
        self.seconds += rollout.seconds
        self.last_reason = rollout.finish_reason
        parsed = self.chat.parse(rollout.response_ids)
        for call in parsed.calls:
            call["id"] = f"call_{self._calls}"
            self._calls += 1
        self._reply = parsed.message()
        self.answer = parsed.content
        return parsed, self._reply

    def trajectory(self, answer: str | None = None, error: str | None = None) -> Trajectory:
        """The rebuilt trajectory; ``answer`` (what the agent printed) is judged, else the last reply's text; an
        ``error`` (the agent crashed, timed out, never asked) aborts it."""
        builder = self.builder or TrajectoryBuilder([])
        if error is None and self.builder is None:
            error = "the agent sent no request"
        reason = "abort" if error else ("length" if self.last_reason == "length" else "stop")
        trajectory = builder.finish(reason, answer if answer else self.answer, error)  # type: ignore[arg-type]
        trajectory.messages = [*self._messages, *([self._reply] if self._reply else [])]
        trajectory.seconds = self.seconds
        trajectory.stats["turns"] = sum(t.kind == "assistant" for t in trajectory.turns)
        trajectory.stats["requests"] = self.requests
        trajectory.stats["segments"] = len(trajectory.segments)
        return trajectory

    def _why_not_extending(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        if self.builder is None:
            return None
        before = len(self._messages)
        if (tools or None) != (self._tools or None):
            return "the tools changed"
        if self.last_reason != "stop":
            return "the previous reply did not end with the stop token"
        if len(messages) <= before + 1 or _key(messages[:before]) != _key(self._messages):
            return "the earlier messages were edited or dropped"
        if _key([messages[before]]) != _key([self._reply]):
            return "the reply was not kept as it was returned"
        if any(m.get("role") == "assistant" for m in messages[before + 1 :]):
            return "the agent added an assistant turn of its own"
        return None

    def _remember(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        self._messages, self._tools = [dict(m) for m in messages], tools
        return self.builder.context_ids


# ---- private ---------------------------------------------------------------------------------------------------


def _key(messages: list[dict[str, Any] | None]) -> str:
    """Messages as comparable text: role, content (``None`` as empty) and tool calls (arguments parsed)."""
    out = []
    for m in messages:
        m = m or {}
        calls = []
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            arguments = fn.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            calls.append([fn.get("name"), arguments])
        out.append([m.get("role"), m.get("content") or "", calls])
    return json.dumps(out, sort_keys=True)
