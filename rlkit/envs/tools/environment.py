"""An environment whose model may call tools before it answers.

Each model turn is parsed for tool calls (the parser its chat template taught it, `parser`): a
turn with calls gets their results back as tool messages and the episode goes on; a turn
without calls is the answer, scored by `score`. The episode's turn and token budgets
(env_runner.max_turns, max_total_tokens) end one that never answers.

    class Calculator(ToolEnvironment):
        def tools(self):
            return [multiply]                      # typed functions with docstrings (or methods_of(self))

        def score(self, answer, metadata):
            return float(answer.strip() == metadata["answer"])
"""

from typing import Callable

from rlkit.envs.base import Environment, EnvStep
from rlkit.envs.tools.parsing import load_parser
from rlkit.envs.tools.schema import ToolDefinitionError
from rlkit.envs.tools.toolbox import ToolBox, check_tools, tool_metrics

# the shortest value of each JSON schema type: a call's arguments at their shortest
_SHORTEST = {"string": "", "integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}


class ToolEnvironment(Environment):
    parser = "hermes"  # a name in rlkit.envs.tools.PARSERS, or an importable parser class
    tool_timeout_s = 10.0  # a call that runs longer is stopped (its process killed) and answered with a timeout error

    def tools(self) -> list[Callable]:
        """The tools offered to the model."""
        raise NotImplementedError

    def score(self, answer: str, metadata: dict) -> EnvStep | float:
        """The model's final answer (its last turn's text, no tool calls in it): an EnvStep, or a reward."""
        raise NotImplementedError

    @property
    def toolbox(self) -> ToolBox:
        if "_toolbox" not in self.__dict__:  # built on first use: subclasses need not call a constructor
            self._parser = load_parser(self.parser)
            self._toolbox = ToolBox(self.tools(), self.tool_timeout_s)
        return self._toolbox

    @classmethod
    def check_arguments(cls, **kwargs) -> str | None:
        """The environment built with these arguments, its tools, parser and time limit checked as
        the worker will build them (all but the tools' schemas, read once the run has started:
        check_prompts): the first problem, one line naming the key, or None."""
        name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            env = cls(**kwargs)
            load_parser(env.parser)
            check_tools(env.tools(), env.tool_timeout_s)
        except ToolDefinitionError as e:
            key = f"env.{e.attribute}" if e.attribute in kwargs else f"env._target_: {name}.{e.attribute}"
            return f"{key}: {e}"
        except Exception as e:  # noqa: BLE001 - the user's constructor or tools(): theirs to see, in one line
            return (f"env._target_: building {name} raised {type(e).__name__}: {' '.join(str(e).split())}; fix its "
                    f"constructor or tools(), or the env.* keys given to it")
        return None

    def shortest_tool_call(self) -> str | None:
        """The shortest call of any tool, required arguments at their shortest values, as the model
        writes it (None where the parser cannot write calls: it has no format_call)."""
        schemas = self.toolbox.schemas  # the parser is built with the toolbox
        if not hasattr(self._parser, "format_call"):
            return None
        calls = []
        for schema in schemas:
            function = schema["function"]
            properties = function.get("parameters", {}).get("properties", {})
            arguments = {key: _SHORTEST.get(properties[key].get("type"), "")
                         for key in function.get("parameters", {}).get("required", [])}
            calls.append(self._parser.format_call(function["name"], arguments))
        return min(calls, key=len, default=None)

    def setup(self) -> None:
        self.toolbox  # its schemas import transformers: seconds, more on a loaded machine

    def close(self) -> None:
        # the tool process, forked from this one, holds copies of its files and pipes (a run's
        # process-group lifeline among them: the run would wait for it at its end)
        if "_toolbox" in self.__dict__:
            self._toolbox.process.stop()

    def tool_schemas(self) -> list[dict]:
        """What the chat template shows the model (PromptRenderer's tools)."""
        return self.toolbox.schemas

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        toolbox = self.toolbox
        turn = self._parser.parse(messages[-1]["content"])
        if not turn.calls:
            scored = self.score(turn.content, metadata)
            return scored if isinstance(scored, EnvStep) else EnvStep(reward=float(scored), done=True)
        results = [toolbox.call(call) for call in turn.calls]
        return EnvStep(reward=0.0, done=False, tool_messages=[r.message() for r in results],
                       counts=tool_metrics(results), faults=[r.fault for r in results if r.fault] or None)


def environment_tools(env_cfg: dict) -> list[dict] | None:
    """The tool schemas of the environment env_cfg names (its `_target_` and keyword arguments),
    or None when it offers no tools: what the prompts' chat template shows the model."""
    from rlkit.envs.base import import_target, load_environment

    target = env_cfg["_target_"]
    cls = import_target(target)
    if not (isinstance(cls, type) and issubclass(cls, ToolEnvironment)):
        return None
    return load_environment(target, {k: v for k, v in env_cfg.items() if k != "_target_"}).tool_schemas()
