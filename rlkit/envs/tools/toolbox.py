"""Running the model's tool calls. Every way a call can fail is the model's to see, as the tool
message it gets back, and the run's to count; none of them stops the run:

  malformed      the call could not be read (not JSON, no name, arguments not an object)
  partial        the turn ended inside a call (cut off by the token budget)
  unknown_tool   no tool of that name
  bad_arguments  missing, unexpected or mistyped arguments (checked against the annotations)
  raised         the tool raised an exception
  timeout        the tool did not return within the time limit

A call runs in a thread of its own, so a tool that hangs costs its trajectory the time limit and
no more; Python cannot stop a thread, so a hung tool's thread is left behind (it is a daemon).
Tools that may not return at all belong in a subprocess: the code tool runs in the sandbox.
"""

import inspect
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from rlkit.envs.base import fits_annotation
from rlkit.envs.tools.parsing import ToolCall
from rlkit.envs.tools.schema import tool_schema

FAILURES = ("malformed", "partial", "unknown_tool", "bad_arguments", "raised", "timeout")


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool called ("" when the call could not be read)
    content: str  # what the model reads in the tool message
    failure: str | None = None  # one of FAILURES; None when the tool returned
    seconds: float = 0.0

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
        self.schemas = [tool_schema(fn) for fn in tools]  # refuses an undescribable tool now
        self.tools = {fn.__name__: fn for fn in tools}
        if len(self.tools) != len(tools):
            raise TypeError(f"two tools share a name among {[fn.__name__ for fn in tools]}")
        self.signatures = {name: inspect.signature(fn, eval_str=True) for name, fn in self.tools.items()}
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars

    def call(self, call: ToolCall) -> ToolResult:
        if call.kind != "ok":
            return ToolResult(call.name or "", f"Error: the tool call could not be read: {call.error}.", call.kind)
        fn = self.tools.get(call.name)
        if fn is None:
            return ToolResult(call.name, f"Error: there is no tool named {call.name!r}; the tools are "
                                         f"{', '.join(sorted(self.tools))}.", "unknown_tool")
        problem = self._argument_problem(call.name, call.arguments)
        if problem:
            return ToolResult(call.name, f"Error: {call.name}{self.signatures[call.name]}: {problem}.",
                              "bad_arguments")
        return self._run(call.name, fn, call.arguments)

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

    def _run(self, name: str, fn: Callable, arguments: dict) -> ToolResult:
        outcome: dict = {}

        def target():
            try:
                outcome["value"] = fn(**arguments)
            except Exception as e:  # noqa: BLE001 - the model's to see
                outcome["error"] = e

        start = time.perf_counter()
        thread = threading.Thread(target=target, daemon=True, name=f"tool-{name}")
        thread.start()
        thread.join(self.timeout_s)
        seconds = time.perf_counter() - start
        if thread.is_alive():
            return ToolResult(name, f"Error: {name} did not finish within {self.timeout_s:g} s.", "timeout", seconds)
        if "error" in outcome:
            error = outcome["error"]
            return ToolResult(name, f"Error: {name} raised {type(error).__name__}: {error}", "raised", seconds)
        return ToolResult(name, self._text(outcome["value"]), None, seconds)

    def _text(self, value) -> str:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > self.max_result_chars:
            text = text[:self.max_result_chars] + f"... [{len(text) - self.max_result_chars} more characters]"
        return text


def tool_metrics(results: list[ToolResult]) -> dict[str, float]:
    """Counts over calls, which add up over episodes and steps: tools/calls, tools/returned (the
    calls whose tool returned), and tools/<failure> for every failure kind (0 when none)."""
    failures = Counter(r.failure for r in results)
    return {"tools/calls": float(len(results)), "tools/returned": float(failures[None]),
            **{f"tools/{kind}": float(failures[kind]) for kind in FAILURES}}


def valid_fraction(counts: dict[str, float]) -> dict[str, float]:
    """tools/valid_fraction from added-up counts (tool_metrics): the share of calls that returned."""
    return {"tools/valid_fraction": counts["tools/returned"] / counts["tools/calls"]} if counts.get("tools/calls") else {}
