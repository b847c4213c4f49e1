"""Tools an environment offers the model: plain typed Python functions (or a class's methods).

schema.py   a tool's JSON schema, from its signature and docstring (what the chat template shows)
parsing.py  the model's tool calls out of its text, in the format its chat template taught it
toolbox.py  running calls with a time limit; every failure becomes a tool message and a count
process.py  the child process calls run in, killed at the time limit
environment.py  ToolEnvironment: parse each turn, answer its calls, score the final answer
code.py     PythonSandbox.run_python: model-written programs as a tool, in the code sandbox
"""

from rlkit.envs.tools.environment import ToolEnvironment, environment_tools
from rlkit.envs.tools.parsing import PARSERS, ParsedTurn, ToolCall, ToolCallParser, load_parser
from rlkit.envs.tools.process import ToolArgumentError
from rlkit.envs.tools.schema import ToolDefinitionError, tool_schema
from rlkit.envs.tools.toolbox import FAILURES, ToolBox, ToolResult, methods_of, tool_metrics, valid_fraction

__all__ = ["FAILURES", "PARSERS", "environment_tools", "ParsedTurn", "ToolArgumentError", "ToolBox", "ToolCall",
           "ToolCallParser", "ToolDefinitionError", "ToolEnvironment", "ToolResult",
           "load_parser", "methods_of", "tool_metrics", "tool_schema", "valid_fraction"]
