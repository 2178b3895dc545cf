"""Black-box agents through the OpenAI-compatible endpoint: the trajectory rebuilt from the session equals the
multi-turn loop's (ids, mask, log-probabilities), an edited history starts a new segment and says so, plain HTTP and
streaming work, and a crashing, hanging or silent agent costs its own sample."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.rl.agent.agents import calculator_agent
from tests.rl.agent.scripted import ScriptedEngine, call, tiny_chat
from xtl.errors import ConfigError
from xtl.rl import SamplingSettings
from xtl.rl.agent import AgentContext, BlackBoxAgentLoop, SessionServer, ToolLoop
from xtl.rl.rollout import Rollout

ROOT = Path(__file__).resolve().parents[3]
QUESTIONS = {"What is 347*582?": "347*582", "What is 12*34?": "12*34"}
TOOLS = ToolLoop(["xtl.agent_tools.calculator"]).schemas
SCRIPT = {
    q: [call("calculator", json.dumps({"expression": e})), f"</think>\n\n{eval(e)}"] for q, e in QUESTIONS.items()
}


def _rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": q}], "answer": str(eval(e)), "tools": TOOLS}
            for q, e in QUESTIONS.items()]  # fmt: skip


def _blackbox(mode: str = "calculator", **settings) -> tuple:
    chat = tiny_chat()
    engine = ScriptedEngine(chat, SCRIPT)
    loop = BlackBoxAgentLoop(command=[sys.executable, "-m", "tests.rl.agent.agents", mode], **settings)
    try:
        return engine, loop.rollout(_rows(), engine, SamplingSettings(), AgentContext(chat))
    finally:
        loop.close()


class TestSameTrajectories:
    @pytest.mark.parametrize("mode", ["calculator", "stream"])
    def test_an_openai_client_agent_gives_the_tool_loops_trajectories(self, mode: str) -> None:
        chat = tiny_chat()
        looped = ToolLoop(["xtl.agent_tools.calculator"]).rollout(
            _rows(), ScriptedEngine(chat, SCRIPT), SamplingSettings(), AgentContext(chat)
        )
        engine, served = _blackbox(mode, batch_wait_s=20)
        for ours, theirs in zip(looped, served, strict=True):
            assert len(theirs.segments) == 1 and theirs.notes == []
            a, b = ours.segments[0], theirs.segments[0]
            assert (a.prompt_ids, a.response_ids, a.loss_mask, a.logprobs) == (
                b.prompt_ids, b.response_ids, b.loss_mask, b.logprobs
            )  # fmt: skip
            assert theirs.response == ours.response and theirs.finish_reason == "stop"
            assert theirs.stats["requests"] == 2 and [t.kind for t in theirs.turns] == [t.kind for t in ours.turns]
        assert engine.calls == 2  # the two agents' requests shared each engine call

    def test_a_function_agent_on_a_thread(self) -> None:
        chat = tiny_chat()
        loop = BlackBoxAgentLoop(function=calculator_agent)
        try:
            trajectories = loop.rollout(_rows(), ScriptedEngine(chat, SCRIPT), SamplingSettings(), AgentContext(chat))
        finally:
            loop.close()
        assert [t.response for t in trajectories] == ["201954", "408"]


class TestRebuild:
    def test_an_edited_history_starts_a_new_segment_and_the_notes_say_why(self) -> None:
        _, (trajectory, _) = _blackbox("edit")
        assert len(trajectory.segments) == 2
        assert trajectory.notes == ["request 2 starts segment 2: the earlier messages were edited or dropped"]
        first, second = trajectory.segments
        chat = tiny_chat()
        edited = [*_rows()[0]["prompt"], {"role": "user", "content": "The calculator says 201954."}]
        assert second.prompt_ids == chat.prompt_ids(edited, TOOLS)  # the new segment starts at its own rendering
        assert set(first.loss_mask) == {1} and set(second.loss_mask) == {1}
        assert trajectory.stats["segments"] == 2


class TestFailures:
    def test_a_crashing_and_a_failing_agent_abort_their_own_samples(self) -> None:
        _, trajectories = _blackbox("crash")
        assert [t.finish_reason for t in trajectories] == ["abort", "abort"]
        assert "the agent exited with code 1: RuntimeError: the agent crashed" in trajectories[0].error
        _, trajectories = _blackbox("exit")
        assert trajectories[0].error == "the agent exited with code 3"

    def test_a_hanging_agent_is_killed_at_its_time_out(self) -> None:
        began = time.perf_counter()
        _, trajectories = _blackbox("hang", timeout_s=4)
        assert time.perf_counter() - began < 30
        assert all(t.finish_reason == "abort" and "time-out" in t.error for t in trajectories)

    def test_settings_are_checked(self) -> None:
        with pytest.raises(ConfigError, match="as a command or as a function"):
            BlackBoxAgentLoop()
        with pytest.raises(ConfigError, match="ray runs a function"):
            BlackBoxAgentLoop(command="agent", ray=True)


class TestEndpoint:
    def test_plain_http_requests_and_refusals(self) -> None:
        chat = tiny_chat()
        server = SessionServer(chat)
        try:
            session = server.open("key-1")
            body = {"messages": [{"role": "user", "content": "What is 12*34?"}], "tools": TOOLS}

            def post(payload: dict, key: str = "key-1") -> tuple[int, dict]:
                request = urllib.request.Request(
                    f"{server.base_url}/chat/completions", json.dumps(payload).encode(),
                    {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                )  # fmt: skip
                try:
                    with urllib.request.urlopen(request, timeout=30) as response:
                        return response.status, json.loads(response.read())
                except urllib.error.HTTPError as err:
                    return err.code, json.loads(err.read())

            import threading

            replies: list = []
            thread = threading.Thread(target=lambda: replies.append(post(body)))
            thread.start()
            (request,) = server.take(lambda: 1, 10.0)
            assert request.prompt_ids == chat.prompt_ids(body["messages"], TOOLS)
            ids, _ = ScriptedEngine(chat, SCRIPT).turn(request.prompt_ids)
            server.answer(request, Rollout(request.prompt_ids, ids, "stop"))
            thread.join()
            status, reply = replies[0]
            assert status == 200 and reply["choices"][0]["finish_reason"] == "tool_calls"
            (tool_call,) = reply["choices"][0]["message"]["tool_calls"]
            assert json.loads(tool_call["function"]["arguments"]) == {"expression": "12*34"}
            assert reply["usage"]["completion_tokens"] == len(ids) and session.requests == 1
            assert post(body, "nobody")[0] == 401
            assert post({"messages": []})[0] == 400
            with urllib.request.urlopen(f"{server.base_url}/models", timeout=10) as response:
                assert json.loads(response.read())["data"][0]["id"] == "xtl-policy"
        finally:
            server.shutdown()
