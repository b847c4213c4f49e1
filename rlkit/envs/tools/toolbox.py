"""Running the model's tool calls. Every way a call can fail is the model's to see, as the tool
message it gets back, and the run's to count (tools/<kind>, on the console line as tool_fail);
none of them stops the run, unless env_runner.fail_fast is on and the tool itself failed (raised,
timeout):

  malformed      the call could not be read (not JSON, no name, arguments not an object)
  partial        the turn ended inside a call (cut off by the token budget)
  unknown_tool   no tool of that name
  bad_arguments  missing, unexpected or mistyped arguments (checked against the annotations), or
                 values the tool refused (it raised ToolArgumentError: 7 / 2 to an exact division)
  raised         the tool raised an exception (or ended its own process)
  timeout        the tool did not return within the time limit: its process is killed

Calls run in a child process (process.py), killed at the time limit and started again for the
next call, so a tool that never returns costs its call the time limit and leaves nothing behind.
Tools are checked when the ToolBox is built (ToolDefinitionError, one line naming the tool).
"""

import inspect
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from rlkit.envs.base import fits_annotation
from rlkit.envs.tools.parsing import ToolCall
from rlkit.envs.tools.process import ToolProcess
from rlkit.envs.tools.schema import ToolDefinitionError, tool_schema

FAILURES = ("malformed", "partial", "unknown_tool", "bad_arguments", "raised", "timeout")


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool called ("" when the call could not be read)
    content: str  # what the model reads in the tool message
    failure: str | None = None  # one of FAILURES; None when the tool returned
    seconds: float = 0.0
    fault: str = ""  # the tool's own failure (raised, timeout) in one line, for env_runner.fail_fast

    def message(self) -> dict:
        """The tool message appended to the conversation (rendered by the chat template)."""
        return {"role": "tool", "name": self.name, "content": self.content}


def methods_of(instance: object) -> list[Callable]:
    """A class's tools: the public methods of `instance` that have a docstring."""
    return [getattr(instance, name) for name, member in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and inspect.getdoc(member)]


class ToolBox:
    """The tools one environment offers, by name, with their schemas."""

    def __init__(self, tools: list[Callable], timeout_s: float = 10.0, max_result_chars: int = 2000):
        check_tools(tools, timeout_s)
        self.schemas = [tool_schema(fn) for fn in tools]  # refuses an undescribable tool now
        self.tools = {fn.__name__: fn for fn in tools}
        self.signatures = {name: inspect.signature(fn, eval_str=True) for name, fn in self.tools.items()}
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.process = ToolProcess(self.tools, self._text)

    def call(self, call: ToolCall) -> ToolResult:
        if call.kind != "ok":
            return ToolResult(call.name or "", f"Error: the tool call could not be read: {call.error}.", call.kind)
        if call.name not in self.tools:
            return ToolResult(call.name, f"Error: there is no tool named {call.name!r}; the tools are "
                                         f"{', '.join(sorted(self.tools))}.", "unknown_tool")
        problem = self._argument_problem(call.name, call.arguments)
        if problem:
            return ToolResult(call.name, f"Error: {call.name}{self.signatures[call.name]}: {problem}.",
                              "bad_arguments")
        return self._run(call.name, call.arguments)

    def _argument_problem(self, name: str, arguments: dict) -> str | None:
        signature = self.signatures[name]
        try:
            signature.bind(**arguments)
        except TypeError as e:
            return str(e)
        for key, value in arguments.items():
            annotation = signature.parameters[key].annotation
            if not fits_annotation(value, annotation):
                return f"{key} must be {inspect.formatannotation(annotation)} (got {value!r:.80})"
        return None

    def _run(self, name: str, arguments: dict) -> ToolResult:
        reply = self.process.call(name, arguments, self.timeout_s)
        if reply.failure == "timeout":
            return ToolResult(name, f"Error: {name} did not finish within {self.timeout_s:g} s.", "timeout",
                              reply.seconds, f"tool {name} {reply.error} (stopped, counted in tools/timeout)")
        if reply.failure == "refused":
            return ToolResult(name, f"Error: {name}{self.signatures[name]}: {reply.error}.", "bad_arguments",
                              reply.seconds)
        if reply.failure == "raised":
            where = f" ({reply.where})" if reply.where else ""
            return ToolResult(name, f"Error: {name} raised {reply.error}", "raised", reply.seconds,
                              f"tool {name} raised {reply.error}{where}")
        return ToolResult(name, reply.value, None, reply.seconds)

    def _text(self, value) -> str:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > self.max_result_chars:
            text = text[:self.max_result_chars] + f"... [{len(text) - self.max_result_chars} more characters]"
        return text


def check_tools(tools: list[Callable], timeout_s: float) -> None:
    """What a ToolBox refuses short of the tools' JSON schemas (transformers' reading, which
    imports torch): checked with the config, where the CLI answers without torch."""
    check_timeout(timeout_s)
    for fn in tools:
        if not callable(fn):
            raise ToolDefinitionError("tools()", f"{fn!r:.60} is not a function (got: {type(fn).__name__}); "
                                                 f"offer functions or bound methods")
        if not inspect.getdoc(fn):
            raise ToolDefinitionError("tools()", f"tool {fn.__name__}: no docstring, so the model is never told "
                                                 f"what it does; give it a type hint on every parameter and a "
                                                 f"docstring with a first line and an Args: line per parameter")
    names = [fn.__name__ for fn in tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ToolDefinitionError("tools()", f"two tools are named {', '.join(twice)} (got: {', '.join(names)}); "
                                             f"give each tool a name of its own")


def check_timeout(timeout_s) -> None:
    """A tool's time limit: seconds, above 0 and finite (0 would fail every call, inf never stop one)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ToolDefinitionError("tool_timeout_s", f"must be a finite number of seconds > 0 (got: {timeout_s!r}); "
                                                    f"set the seconds one tool call may take, e.g. 5")


def tool_metrics(results: list[ToolResult]) -> dict[str, float]:
    """Counts over calls, which add up over episodes and steps: tools/calls, tools/returned (the
    calls whose tool returned), and tools/<failure> for every failure kind (0 when none)."""
    failures = Counter(r.failure for r in results)
    return {"tools/calls": float(len(results)), "tools/returned": float(failures[None]),
            **{f"tools/{kind}": float(failures[kind]) for kind in FAILURES}}


def valid_fraction(counts: dict[str, float]) -> dict[str, float]:
    """tools/valid_fraction from added-up counts (tool_metrics): the share of calls that returned."""
    return {"tools/valid_fraction": counts["tools/returned"] / counts["tools/calls"]} if counts.get("tools/calls") else {}
