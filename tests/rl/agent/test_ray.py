"""Agent loops on Ray: tools as Ray tasks (cancelled at their time-out) and black-box agents as Ray tasks."""

from __future__ import annotations

import time

from tests.rl.agent.agents import calculator_agent
from tests.rl.agent.scripted import ScriptedEngine, tiny_chat
from tests.rl.agent.test_blackbox import SCRIPT, _rows
from tests.rl.test_remote import local_ray  # noqa: F401 - the module's Ray cluster
from xtl.agent_tools import calculator
from xtl.rl import SamplingSettings
from xtl.rl.agent import AgentContext, BlackBoxAgentLoop, Tool


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"


class TestOnRay:
    def test_tools_run_as_tasks_and_time_out(self, local_ray) -> None:  # noqa: F811
        assert Tool(calculator, ray=True).call({"expression": "347*582"}).content == "201954"
        assert Tool(calculator, ray=True).call({"expression": "1/0"}).content.startswith("Error: ZeroDivisionError")
        began = time.perf_counter()
        result = Tool(nap, ray=True, timeout_s=1).call({"seconds": 60})
        assert result.status == "timeout" and time.perf_counter() - began < 20

    def test_a_function_agent_as_a_ray_task(self, local_ray) -> None:  # noqa: F811
        chat = tiny_chat()
        loop = BlackBoxAgentLoop(function=calculator_agent, ray=True, timeout_s=120)
        try:
            trajectories = loop.rollout(_rows(), ScriptedEngine(chat, SCRIPT), SamplingSettings(), AgentContext(chat))
        finally:
            loop.close()
        assert [t.response for t in trajectories] == ["201954", "408"]
        assert all(t.stats["requests"] == 2 and t.finish_reason == "stop" for t in trajectories)
