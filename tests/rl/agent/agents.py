"""Black-box agents for the endpoint tests: an OpenAI-client calculator agent (run as ``python -m
tests.rl.agent.agents <mode>`` with the task on stdin, or called as a function), and agents that misbehave."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from xtl.agent_tools import calculator


def calculator_agent(task: dict[str, Any], base_url: str, api_key: str, mode: str = "calculator") -> str:
    """Ask the endpoint, run the calculator on each tool call, send the results back; the last reply is the answer.

    ``mode``: ``calculator`` (as described), ``stream`` (streamed replies), ``edit`` (after the first tool result,
    sends a summarized history instead of the whole conversation), ``crash`` (raises after the first reply),
    ``hang`` (sleeps after the first reply)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    for _ in range(6):
        message = _ask(client, messages, task.get("tools"), stream=mode == "stream")
        if mode == "crash":
            raise RuntimeError("the agent crashed")
        if mode == "hang":
            time.sleep(3600)
        if not message["tool_calls"]:
            return message["content"]
        messages.append({"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]})
        for call in message["tool_calls"]:
            result = calculator(**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if mode == "edit":  # the agent keeps a summary instead of its history, and answers with the next reply
            messages = [*task["messages"], {"role": "user", "content": f"The calculator says {result}."}]
            return _ask(client, messages, task.get("tools"), stream=False)["content"]
    return ""


def _ask(client: Any, messages: list[dict], tools: list[dict] | None, stream: bool) -> dict[str, Any]:
    if not stream:
        reply = client.chat.completions.create(model="xtl-policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
        return {"content": message.content or "", "tool_calls": calls}
    content, calls = "", []
    for chunk in client.chat.completions.create(model="xtl-policy", messages=messages, tools=tools, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": call.function.arguments}})  # fmt: skip
    return {"content": content, "tool_calls": calls}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "calculator"
    if mode == "exit":
        sys.exit(3)
    task = json.loads(sys.stdin.read())
    print(calculator_agent(task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], mode))
