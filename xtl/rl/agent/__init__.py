"""Agent loops for RL: how a prompt becomes a token-exact trajectory (:mod:`xtl.rl.agent.loop`).

- :class:`SingleTurnLoop`: one completion per prompt (the default);
- :class:`ToolLoop`: multi-turn tool use (:mod:`xtl.rl.agent.tool_loop`, tools in :mod:`xtl.rl.agent.tools`);
- :class:`EnvironmentLoop`: ``reset``/``step`` environments (:mod:`xtl.rl.agent.environment`);
- :class:`BlackBoxAgentLoop`: external agents through an OpenAI-compatible endpoint (:mod:`xtl.rl.agent.blackbox`,
  :mod:`xtl.rl.agent.endpoint`, :mod:`xtl.rl.agent.session`).

Trajectories (:mod:`xtl.rl.agent.trajectory`) keep the sampled ids as sampled, with a loss mask over them and the
chat template's continuations (:mod:`xtl.rl.agent.chat`) as context.
"""

from xtl.rl.agent.blackbox import BlackBoxAgentLoop
from xtl.rl.agent.chat import ChatFormat, ParsedTurn
from xtl.rl.agent.endpoint import SessionServer
from xtl.rl.agent.environment import EnvironmentLoop
from xtl.rl.agent.loop import AgentContext, AgentLoop, SingleTurnLoop, lockstep_generate
from xtl.rl.agent.session import Session
from xtl.rl.agent.tool_loop import ToolLoop
from xtl.rl.agent.tools import Tool, ToolResult, as_tools
from xtl.rl.agent.trajectory import Segment, Trajectory, TrajectoryBuilder, Turn

__all__ = [
    "AgentContext",
    "AgentLoop",
    "BlackBoxAgentLoop",
    "ChatFormat",
    "EnvironmentLoop",
    "ParsedTurn",
    "Segment",
    "Session",
    "SessionServer",
    "SingleTurnLoop",
    "Tool",
    "ToolLoop",
    "ToolResult",
    "Trajectory",
    "TrajectoryBuilder",
    "Turn",
    "as_tools",
    "lockstep_generate",
]
