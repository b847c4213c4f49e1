"""The model's tool calls, parsed out of a generated turn in the format its chat template uses.

A parser turns the turn's text into the text meant for the user and its calls, each either
well-formed (a name and a dict of arguments) or with the reason it is not; a malformed call is
the model's mistake, answered with a tool message, never an exception. Parsers are chosen per
model by name (PARSERS) or by an importable path to a class of your own with the same `parse`.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

from rlkit.envs.base import import_target
from rlkit.envs.tools.schema import ToolDefinitionError


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict | None
    raw: str  # the call as the model wrote it
    error: str | None = None  # why it could not be read; None when well-formed
    kind: str = "ok"  # "ok", "malformed" (unreadable) or "partial" (cut off before its end)


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text outside the calls
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...

    # optional: `format_call(name, arguments) -> str`, a call as the model writes it, lets a run whose
    # token budget cannot hold the shortest call be warned (rlkit/launch/preflight.py)


class HermesParser:
    """Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    (arguments may also come as a JSON string, as some models write them)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls = [_read_call(m.group(1)) for m in self._BLOCK.finditer(text)]
        content = self._BLOCK.sub("", text)
        cut = content.find(self.OPEN)
        if cut >= 0:  # an opening tag never closed: the turn ended inside a call
            raw = content[cut + len(self.OPEN):]
            calls.append(ToolCall(None, None, raw.strip(), f"the call was cut off before {self.CLOSE}", "partial"))
            content = content[:cut]
        return ParsedTurn(content.strip(), calls)

    def format_call(self, name: str, arguments: dict) -> str:
        return f"{self.OPEN}{json.dumps({'name': name, 'arguments': arguments})}{self.CLOSE}"


def _read_call(body: str) -> ToolCall:
    raw = body.strip()
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, raw, f"not valid JSON ({e.msg} at character {e.pos})", "malformed")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, None, raw, 'expected {"name": "<tool>", "arguments": {...}}', "malformed")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(call["name"], None, raw, f"arguments are not valid JSON ({e.msg})", "malformed")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], None, raw, "arguments must be a JSON object", "malformed")
    return ToolCall(call["name"], arguments, raw)


PARSERS: dict[str, type] = {"hermes": HermesParser}


def load_parser(name: str) -> ToolCallParser:
    """A parser by its name in PARSERS, or by an importable path (my_module.MyParser)."""
    if name in PARSERS:
        return PARSERS[name]()
    try:
        return import_target(name)()
    except (ImportError, AttributeError) as e:
        raise ToolDefinitionError("parser", f"unknown tool-call parser {name!r} ({e}); use one of {sorted(PARSERS)} "
                                            f"or an importable class path") from None
