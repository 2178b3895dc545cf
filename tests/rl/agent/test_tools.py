"""Tools: schemas from docstrings, time-outs, subprocess limits, and the built-in calculator and python tools."""

from __future__ import annotations

import time
import warnings

import pytest

from xtl.agent_tools import calculator, python
from xtl.errors import ConfigError
from xtl.rl.agent.tools import Tool, as_tools


def undocumented(x):  # noqa: ANN001, ANN201 - no type hints, no docstring
    return x


class TestDeclaration:
    def test_the_schema_comes_from_the_signature_and_docstring(self) -> None:
        (tool,) = as_tools(["xtl.agent_tools.calculator"])
        function = tool.schema["function"]
        assert tool.name == "calculator" and function["description"] == "Evaluate an arithmetic expression exactly."
        assert function["parameters"]["required"] == ["expression"]

    def test_an_explicit_schema_and_a_mapping_are_taken(self) -> None:
        schema = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
        (tool,) = as_tools([{"function": "xtl.agent_tools:calculator", "schema": schema, "timeout_s": 2}])
        assert tool.name == "calc" and tool.timeout_s == 2 and tool.call({"expression": "6*7"}).content == "42"

    def test_bad_declarations_are_refused_with_their_key(self) -> None:
        with pytest.raises(ConfigError, match="cannot derive the schema of .*undocumented"):
            Tool(undocumented)
        with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
            as_tools([calculator, "xtl.agent_tools.calculator"])
        with pytest.raises(ConfigError, match=r"tools\[0\]: a tool is an import path"):
            as_tools([3])
        with pytest.raises(ConfigError, match="timeout_s and memory_mb must be > 0"):
            Tool(calculator, timeout_s=0)


class TestCalls:
    def test_the_calculator_is_exact_and_refuses_code(self) -> None:
        assert calculator("347 * 582") == "201954" and calculator("7/2") == "3.5" and calculator("-(2**10)") == "-1024"
        with pytest.raises(ValueError, match="not arithmetic"):
            calculator("__import__('os').getcwd()")
        with pytest.raises(ValueError, match="exponent"):
            calculator("9**999999")

    def test_a_malformed_literal_is_an_error_without_a_warning(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="not arithmetic"):
                calculator("0x1for 2")
        assert not caught, [str(w.message) for w in caught]

    def test_a_subprocess_tool_runs_code_and_is_killed_at_its_time_out(self) -> None:
        tool = Tool(python, subprocess=True, timeout_s=3)
        assert tool.call({"code": "print(6 * 7)"}).content == "42\n"
        tool = Tool(python, subprocess=True, timeout_s=0.5)
        began = time.perf_counter()
        result = tool.call({"code": "while True: pass"})
        assert result.status == "timeout" and time.perf_counter() - began < 3

    def test_a_subprocess_tool_has_a_memory_limit(self) -> None:
        result = Tool(python, subprocess=True, memory_mb=256, timeout_s=10).call({"code": "x = bytearray(2**31)"})
        assert result.status == "error" and "MemoryError" in result.content

    def test_an_in_process_error_is_text_for_the_model(self) -> None:
        result = Tool(calculator).call({"expression": "1/0"})
        assert result.status == "error" and result.content == "Error: ZeroDivisionError: division by zero"
