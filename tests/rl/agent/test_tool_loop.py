"""The multi-turn tool loop on a scripted engine: ids, loss masks and log-probabilities turn by turn, and what a
malformed call, a hung or failing tool and each budget cost (a turn or the trajectory, never the run)."""

from __future__ import annotations

import time

import pytest

from tests.rl.agent.scripted import ScriptedEngine, call, tiny_chat
from xtl.errors import ConfigError
from xtl.rl import SamplingSettings
from xtl.rl.agent import AgentContext, ToolLoop

QUESTION = "What is 347*582?"
CALC = call("calculator", '{"expression": "347*582"}')
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"


def _rows(question: str = QUESTION, n: int = 1) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": question}], "answer": "201954"} for _ in range(n)]


def _run(script: dict, loop: ToolLoop | None = None, n: int = 1, logprobs: bool = True):
    chat = tiny_chat()
    loop = loop or ToolLoop(["xtl.agent_tools.calculator"])
    engine = ScriptedEngine(chat, script, logprobs)
    return chat, engine, loop.rollout(_rows(next(iter(script)), n), engine, SamplingSettings(), AgentContext(chat))


def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def broken(x: int) -> str:
    """Raise.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


class TestTrajectory:
    def test_ids_masks_and_logprobs_turn_by_turn(self) -> None:
        chat, engine, (trajectory,) = _run({QUESTION: [CALC, "</think>\n\n201954"]})
        assert trajectory.finish_reason == "stop" and trajectory.response == "201954"
        assert [t.kind for t in trajectory.turns] == ["assistant", "tool", "assistant"]
        (segment,) = trajectory.segments
        schema = ToolLoop(["xtl.agent_tools.calculator"]).schemas
        assert segment.prompt_ids == chat.prompt_ids(_rows()[0]["prompt"], schema)
        first_ids, first_logps = engine.turn(segment.prompt_ids)
        tool_ids = chat.encode(TOOL_TURN.format("201954"))
        second_ids, second_logps = engine.turn(segment.prompt_ids + first_ids + tool_ids)
        assert segment.response_ids == first_ids + tool_ids + second_ids  # the sampled ids, never re-encoded
        assert segment.loss_mask == [1] * len(first_ids) + [0] * len(tool_ids) + [1] * len(second_ids)
        assert segment.logprobs == first_logps + [0.0] * len(tool_ids) + second_logps
        bounds = [(t.start, t.end) for t in trajectory.turns]
        assert bounds == [(0, len(first_ids)), (len(first_ids), len(first_ids) + len(tool_ids)),
                          (len(first_ids) + len(tool_ids), len(segment.response_ids))]  # fmt: skip
        assert trajectory.stats == {"tool_calls": 1, "turns": 2}
        assert trajectory.messages[2] == {"role": "tool", "content": "201954", "tool_call_id": "call_0"}

    def test_sampled_ids_that_encoding_would_merge_are_kept_as_sampled(self) -> None:
        chat = tiny_chat()
        engine = ScriptedEngine(chat, {QUESTION: [CALC, "201954 is the product"]}, by_character=True)
        loop = ToolLoop(["xtl.agent_tools.calculator"])
        (trajectory,) = loop.rollout(_rows(), engine, SamplingSettings(), AgentContext(chat))
        segment = trajectory.segments[0]
        last = trajectory.turns[-1]
        sampled = segment.response_ids[last.start : last.end]
        assert sampled == engine.turn(segment.prompt_ids + segment.response_ids[: last.start])[0]
        assert sampled[:-1] != chat.encode("201954 is the product")  # encoding the text gives other ids
        assert trajectory.stats["tool_calls"] == 1 and trajectory.response == "201954 is the product"

    def test_an_engine_without_logprobs_gives_none(self) -> None:
        _, _, (trajectory,) = _run({QUESTION: [CALC, "201954"]}, logprobs=False)
        assert trajectory.segments[0].logprobs is None and sum(trajectory.segments[0].loss_mask) > 0

    def test_trajectories_of_a_batch_take_one_engine_call_per_turn(self) -> None:
        _, engine, trajectories = _run({QUESTION: [CALC, CALC, "201954"]}, n=3)
        assert engine.calls == 3 and all(t.stats["turns"] == 3 for t in trajectories)

    def test_a_turn_without_a_call_ends_the_trajectory_at_once(self) -> None:
        _, engine, (trajectory,) = _run({QUESTION: ["42"]})
        assert engine.calls == 1 and trajectory.response == "42"
        assert [t.kind for t in trajectory.turns] == ["assistant"]


class TestFailuresCostATurn:
    def test_a_malformed_call_gets_an_error_turn_and_the_model_may_retry(self) -> None:
        bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'
        chat, _, (trajectory,) = _run({QUESTION: [bad, CALC, "201954"]})
        assert trajectory.finish_reason == "stop" and trajectory.response == "201954"
        assert trajectory.stats["malformed_calls"] == 1 and trajectory.stats["tool_calls"] == 1
        error = trajectory.messages[2]
        assert error["role"] == "tool"
        assert error["content"].startswith("Error: malformed tool call: the tool call is not JSON")
        assert [t.status for t in trajectory.turns if t.kind == "tool"] == ["malformed", "ok"]

    def test_a_hung_tool_times_out(self) -> None:
        loop = ToolLoop(["xtl.agent_tools.calculator", {"function": sleepy, "timeout_s": 0.3}])
        began = time.perf_counter()
        _, _, (trajectory,) = _run({QUESTION: [call("sleepy", '{"seconds": 30}'), "201954"]}, loop)
        assert time.perf_counter() - began < 5
        assert trajectory.stats["tool_timeouts"] == 1 and trajectory.response == "201954"
        assert "timed out after 0.3 s" in trajectory.messages[2]["content"]

    def test_a_raising_tool_and_an_unknown_tool_are_errors(self) -> None:
        loop = ToolLoop(["xtl.agent_tools.calculator", broken])
        script = {QUESTION: [call("broken", '{"x": 3}') + "\n" + call("nope", "{}"), "201954"]}
        _, _, (trajectory,) = _run(script, loop)
        results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        assert results == ["Error: RuntimeError: broken on 3", "Error: unknown tool 'nope'; tools: calculator, broken"]
        assert trajectory.stats["tool_errors"] == 2 and trajectory.stats["tool_calls"] == 2

    def test_wrong_arguments_are_an_error_turn(self) -> None:
        _, _, (trajectory,) = _run({QUESTION: [call("calculator", '{"expr": "1+1"}'), "2"]})
        assert "unexpected keyword argument 'expr'" in trajectory.messages[2]["content"]


class TestBudgets:
    def test_max_turns_ends_with_length(self) -> None:
        loop = ToolLoop(["xtl.agent_tools.calculator"], max_turns=2)
        _, engine, (trajectory,) = _run({QUESTION: [CALC]}, loop)
        assert trajectory.finish_reason == "length" and trajectory.stats["turns"] == 2 and engine.calls == 2
        assert trajectory.turns[-1].kind == "assistant"  # no tool turn after the last allowed one

    def test_calls_past_max_tool_calls_are_refused(self) -> None:
        loop = ToolLoop(["xtl.agent_tools.calculator"], max_tool_calls=1)
        _, _, (trajectory,) = _run({QUESTION: [CALC + "\n" + CALC, "201954"]}, loop)
        contents = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        assert contents == ["201954", "Error: the limit of 1 tool calls is reached"]
        assert trajectory.stats["refused_calls"] == 1

    def test_max_tokens_counts_sampled_and_appended_tokens(self) -> None:
        loop = ToolLoop(["xtl.agent_tools.calculator"], max_tokens=40)
        _, _, (trajectory,) = _run({QUESTION: [CALC, CALC, "201954"]}, loop)
        assert trajectory.finish_reason == "length"
        assert len(trajectory.segments[0].response_ids) >= 40 > trajectory.turns[-1].start

    @pytest.mark.parametrize("setting", ["max_turns", "max_tool_calls", "max_tokens"])
    def test_a_budget_below_one_is_refused(self, setting: str) -> None:
        with pytest.raises(ConfigError, match=f"agent.init_args.{setting} must be >= 1"):
            ToolLoop(["xtl.agent_tools.calculator"], **{setting: 0})

    def test_no_tools_and_a_missing_tool_are_refused(self) -> None:
        with pytest.raises(ConfigError, match="needs at least one tool"):
            ToolLoop([])
        with pytest.raises(ConfigError, match="cannot import 'xtl.agent_tools.nothing'"):
            ToolLoop(["xtl.agent_tools.nothing"])
