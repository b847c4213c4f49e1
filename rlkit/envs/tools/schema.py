"""A tool's JSON schema, from its signature and docstring: transformers' own reading
(`transformers.utils.get_json_schema`, what `apply_chat_template(tools=[fn])` does with a
function), so the model is shown exactly what its chat template would show for that function.

What it needs: a type hint on every parameter (str, int, float, bool, list[...], dict, Literal[...],
X | None), a docstring whose first paragraph says what the tool does, and an "Args:" section
(Google style) with a line for every parameter. A tool that lacks one is refused when the
environment declares it, not when the model first calls it.
"""

from typing import Callable


class ToolDefinitionError(TypeError):
    """An environment's tools cannot be offered as declared: `attribute` is what declares them
    ("tools()", "parser", "tool_timeout_s"), the message the problem and its fix, in one line."""

    def __init__(self, attribute: str, message: str):
        super().__init__(message)
        self.attribute = attribute


def tool_schema(fn: Callable) -> dict:
    """{"type": "function", "function": {"name", "description", "parameters", ...}} for `fn` (a
    function or a bound method; its name is the tool's)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' reasons (no docstring, an argument undescribed, a type)
        reason = " ".join(str(e).split())  # one line
        raise ToolDefinitionError("tools()", f"tool {getattr(fn, '__name__', fn)!s}: {reason}; give it a type hint on "
                                             f"every parameter and a docstring with a first line and an Args: line "
                                             f"per parameter") from None
