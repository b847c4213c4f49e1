"""The environment API.

Subclass `Environment` and implement `step`, or write a plain function
`score(response: str, metadata: dict) -> float` for single-turn scoring. Either is selected with
`env._target_=<importable path>`; the other `env.*` keys are passed to the constructor.

`step(messages, metadata)` gets the conversation so far (OpenAI-style dicts; the last one is the
model's latest answer) and the sample's metadata (every field of its dataset row except the
prompt; the ground truth, data.answer_field, also under "answer"), and
returns an EnvStep. A multi-turn episode continues while `done` is False: `observation` becomes
the next user turn, or `tool_messages` (role "tool") answer the model's tool calls
(rlkit/envs/tools: ToolEnvironment does this for you). Rewards of all turns are summed.
"""

import importlib
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from rlkit.config.named import start_directory_importable


def import_target(target: str):
    """'package.module.Name' -> the object, from the directory rlkit was started from too."""
    start_directory_importable()
    module, _, name = target.rpartition(".")
    if not module:
        raise ImportError(f"{target!r} is not a dotted path like my_module.MyEnv")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class EnvStep:
    reward: float
    done: bool
    observation: str | None = None  # the next user turn when not done
    correct: bool | None = None  # optional: counted as train/accuracy
    tool_messages: list[dict] | None = None  # instead of an observation: the results of the model's tool calls
    counts: dict[str, float] | None = None  # added up over the step's episodes into its metrics (e.g. tools/*)
    # failures of the environment's own code that it answered anyway (a tool that raised or hung), one
    # line each: env_runner.fail_fast stops the run at the first
    faults: list[str] | None = None


class Environment:
    """Base class for environments. Constructor keyword arguments come from `env.*` config keys.

    Besides `step` (and `setup`, for what is slow to load), four optional class-level
    declarations let a run that cannot work stop before any worker starts: `metadata_fields`,
    `check_host`, `check_arguments` and `reference_response`; `start_services` starts what the
    workers share (a model server)."""

    # the row fields step() reads from metadata: a prompt row without one is an error at load
    metadata_fields: tuple[str, ...] = ()
    # what start_services started, by name, set in each worker before setup(); none without a pool (rlkit env check)
    services: dict[str, Any] = {}

    @classmethod
    def start_services(cls, **kwargs) -> dict[str, Any]:
        """Ray actors the environment's workers share (e.g. a model server that batches their
        requests), by name, started with these constructor arguments (every one, defaults filled
        in) by the environment pool before its workers and stopped with it: a replaced worker
        leaves them running. Each worker's environment finds them in `self.services`."""
        return {}

    @classmethod
    def check_host(cls, **kwargs) -> str | None:
        """Why the environment cannot run on this machine with these constructor arguments (every
        one, defaults filled in), or None; checked with the config, before any worker starts."""
        return None

    @classmethod
    def check_arguments(cls, **kwargs) -> str | None:
        """What is wrong with these constructor arguments (every one, defaults filled in) beyond
        their types: a value out of its range, a tool that cannot be offered. One line naming the
        env key and the fix, or None; checked with the config, before any worker starts."""
        return None

    @staticmethod
    def reference_response(metadata: dict) -> str | None:
        """The shortest response this environment scores correct for a row (its ground truth in
        the form step() reads, e.g. "#### 72"), or None where it cannot say. A run whose token
        budget cannot hold these responses is refused (none fits) or warned about (some do not)."""
        return None

    def reference_turns(self, messages: list[dict], metadata: dict) -> list[str] | None:
        """What the model should write for a row, turn by turn (e.g. a tool call, then the
        answer), given its prompt's messages: a warm start (algorithm.warm_start) then trains on
        whole episodes, the environment answering each turn. None: it trains on metadata["answer"]."""
        return None

    def setup(self) -> None:
        """Called once in each environment worker before its first step, outside
        env_runner.timeout_s: load what is slow to load here (a library, a model), or a fresh
        worker's first step may time out while it loads."""

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        raise NotImplementedError

    def close(self) -> None:
        """Called where rlkit steps the environment in a process of its own (the warm start, on
        the driver) once it is done with it: stop what the steps started there. Environment
        workers need none: their processes end with the run."""


class FunctionEnvironment(Environment):
    """Wraps a single-turn scoring function score(response, metadata) -> float."""

    def __init__(self, fn: Callable[[str, dict], float]):
        self.fn = fn

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        return EnvStep(reward=self.fn(messages[-1]["content"], metadata), done=True)


class MalformedStepError(TypeError):
    pass


def as_env_step(value: Any, multi_turn_allowed: bool = True) -> EnvStep:
    """Accept an EnvStep, or a bare number from a scoring function; anything else is malformed."""
    if isinstance(value, EnvStep):
        step = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        step = EnvStep(reward=float(value), done=True)
    else:
        raise MalformedStepError(f"expected EnvStep or a number, got {type(value).__name__}: {value!r:.200}")
    if not isinstance(step.reward, (int, float)) or isinstance(step.reward, bool) or step.reward != step.reward:
        raise MalformedStepError(f"EnvStep.reward must be a finite number, got {step.reward!r:.100}")
    if step.faults is not None and not (isinstance(step.faults, list) and all(isinstance(f, str) for f in step.faults)):
        raise MalformedStepError(f"EnvStep.faults must be a list of strings, got {step.faults!r:.200}")
    if not step.done:
        tools = step.tool_messages
        if tools is not None and not (isinstance(tools, list) and tools and all(
                isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("content"), str) for m in tools)):
            raise MalformedStepError("EnvStep.tool_messages must be a non-empty list of {'role': 'tool', 'content': "
                                     f"str}} dicts, got {tools!r:.200}")
        if tools is None and not isinstance(step.observation, str):
            raise MalformedStepError("EnvStep with done=False needs a string observation (the next user turn) or "
                                     "tool_messages")
        if tools is not None and step.observation is not None:
            raise MalformedStepError("EnvStep gives both an observation and tool_messages; give one")
    return step


def load_environment(target: str, kwargs: dict) -> Environment:
    """Build the environment named by `target` (a class or a function) with `kwargs`."""
    obj = import_target(target)
    if inspect.isclass(obj) and issubclass(obj, Environment):
        return obj(**kwargs)
    if callable(obj) and not inspect.isclass(obj):
        if kwargs:
            raise TypeError(f"{target} is a scoring function and takes no config keys, got {sorted(kwargs)}")
        return FunctionEnvironment(obj)
    raise TypeError(f"{target} is neither an rlkit.envs.Environment subclass nor a scoring function")


def start_services(target: str, kwargs: dict) -> dict[str, Any]:
    """The services of the environment `target` names (Environment.start_services); a scoring
    function has none."""
    obj = import_target(target)
    if inspect.isclass(obj) and issubclass(obj, Environment):
        return obj.start_services(**constructor_arguments(obj, kwargs))
    return {}


def constructor_arguments(cls: type, kwargs: dict) -> dict:
    """kwargs with the constructor's defaults filled in."""
    defaults = {name: p.default for name, p in _constructor_parameters(cls).items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **kwargs}


def check_environment_config(target: str, kwargs: dict) -> str | None:
    """None if `target` imports, accepts `kwargs` and can run here (Environment.check_host);
    otherwise the reason, naming the key."""
    try:
        obj = import_target(target)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to see
        return f"env._target_: cannot import {target!r} ({type(e).__name__}: {e}); check the module path"
    if inspect.isclass(obj) and issubclass(obj, Environment):
        params = _constructor_parameters(obj)
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            for key in kwargs:
                if key not in params:
                    return f"env.{key}: unknown key for {target}; it accepts {sorted(params)}"
        for key, value in kwargs.items():
            param = params.get(key)
            # None fits a parameter whose default is None, annotated so or not (`x: float = None`)
            if param is None or (value is None and param.default is None) or fits_annotation(value, param.annotation):
                continue
            annotation = inspect.formatannotation(param.annotation)
            return (f"env.{key}: {target} takes {annotation} (got: {value!r:.100}, of type {type(value).__name__}); "
                    f"give a value of that type")
        arguments = constructor_arguments(obj, kwargs)
        problem = obj.check_host(**arguments)
        if problem:
            return f"env._target_: {target} cannot run on this machine: {problem}"
        return obj.check_arguments(**arguments)
    if callable(obj) and not inspect.isclass(obj):
        if kwargs:
            return f"env.{sorted(kwargs)[0]}: {target} is a scoring function and takes no config keys"
        try:
            inspect.signature(obj).bind("response", {})
        except TypeError:
            return f"env._target_: {target} must take (response: str, metadata: dict) to be a scoring function"
        return None
    return f"env._target_: {target} is neither an rlkit.envs.Environment subclass nor a scoring function"


def _constructor_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The class's constructor parameters (self excluded), with annotations evaluated where they
    can be (a module with `from __future__ import annotations` has them as strings); one that
    cannot be is left a string, which fits_annotation does not check."""
    try:
        return dict(inspect.signature(cls, eval_str=True).parameters)
    except Exception:  # noqa: BLE001 - e.g. NameError: a name imported only under TYPE_CHECKING
        return dict(inspect.signature(cls).parameters)


# the annotations a config value is checked against: the types YAML and JSON values have
_CHECKED = (bool, int, float, str, list, dict, tuple)


def fits_annotation(value, annotation) -> bool:
    """Whether a config (or JSON) value fits an annotation: int, float, bool, str, list, dict
    (containers shallowly: list[int] takes any list), unions such as Optional[int] or int | None,
    and Literal. A bool fits only bool (though Python counts it an int), an int fits float (a
    recipe may well write 1 for 1.0) and a list fits tuple (YAML and JSON have no tuples). Other
    annotations (unannotated, Any, a class, Callable, a string left unevaluated) take anything."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(fits_annotation(value, arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is None or annotation is type(None):
        return value is None
    annotation = origin or annotation
    if annotation not in _CHECKED:
        return True
    if isinstance(value, bool) or annotation is bool:
        return isinstance(value, bool) and annotation is bool
    if annotation is float:
        return isinstance(value, (int, float))
    if annotation is tuple:
        return isinstance(value, (list, tuple))
    return isinstance(value, annotation)
