"""Built-in environments, the math verifier, the env API's checks and failure recording."""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Optional

import pytest

from rlkit.envs.arithmetic import ArithmeticEnv, GuessSumEnv
from rlkit.envs.base import (EnvStep, Environment, MalformedStepError, as_env_step, check_environment_config,
                             load_environment)
from rlkit.envs.math_answers import MathEnv, answers_match, extract_answer
from rlkit.envs.runner import EnvWorker, safe_step
from rlkit.envs.tools import ToolEnvironment
from test_tools import running


def conversation(*turns: str) -> list[dict]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{72}", "72"),
    ("\\boxed{1} then \\boxed{x^{2}+1}", "x^{2}+1"),  # last box, nested braces
    ("work...\n#### 1,000", "1,000"),
    ("#### 5\nmore\n#### 6", "6"),
    ("\\boxed{unclosed", None),
    ("no final answer", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# math-verify compares final answers as mathematics
EQUAL = [("thus \\boxed{72.0}", "72"), ("#### 1,000", "1000"), ("\\boxed{\\$1,000.00}", "1000"),
         ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{-3}", "-3.0"),
         ("\\boxed{x^2+2x+1}", "(x+1)^2"), ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
         ("\\boxed{3 \\text{ apples}}", "3"),
         ("#### 18", "She sells 16 - 3 - 4 = 9 eggs at $2: 9 * 2 = 18\n#### 18"),  # a whole GSM8K solution
         ("\\boxed{10}", "so the total is \\boxed{10}.")]  # a whole MATH solution
# wrong answers that look right
DIFFERENT = [("\\boxed{12}", "21"), ("I first get 12, then \\boxed{13}", "12"), ("\\boxed{1.0001}", "1"),
             ("\\boxed{71}", "72"), ("\\boxed{-3}", "3"), ("\\boxed{2\\pi}", "6.28"),
             ("the answer is 72", "72"),  # no final answer given: nothing to compare
             ("#### 5\nthen \\boxed{6}", "5")]  # the boxed answer is the final one


@pytest.mark.parametrize("response, truth", EQUAL)
def test_equal_answers_match(response, truth):
    assert answers_match(response, truth)


@pytest.mark.parametrize("response, truth", DIFFERENT)
def test_wrong_answers_that_look_right_do_not_match(response, truth):
    assert not answers_match(response, truth)


def test_math_env():
    env = MathEnv()
    assert env.step(conversation("q", "thus \\boxed{72.0}"), {"answer": "72"}) == EnvStep(1.0, True, correct=True)
    assert env.step(conversation("q", "#### 7"), {"answer": 8}) == EnvStep(0.0, True, correct=False)
    formatted = MathEnv(format_reward=0.1)
    assert formatted.step(conversation("q", "#### 7"), {"answer": 8}) == EnvStep(0.1, True, correct=False)
    assert formatted.step(conversation("q", "7"), {"answer": 7}) == EnvStep(0.0, True, correct=False)


def test_arithmetic_env_exact_integer():
    env = ArithmeticEnv(correct_reward=2.0, wrong_reward=-1.0)
    assert env.step(conversation("3+4=", " 7 "), {"answer": "7"}).reward == 2.0
    assert env.step(conversation("3+4=", "7.0"), {"answer": "7"}).reward == -1.0


def test_guess_sum_feedback_and_discount():
    env = GuessSumEnv(turn_discount=0.5)
    low = env.step(conversation("3+4=", "5"), {"answer": "7"})
    assert (low.done, low.reward, low.observation) == (False, 0.0, " higher\n3+4=")
    assert env.step(conversation("3+4=", "9"), {"answer": "7"}).observation.startswith(" lower")
    assert env.step(conversation("3+4=", "??"), {"answer": "7"}).observation.startswith(" a number please")
    second = env.step(conversation("3+4=", "5", " higher\n3+4=", "7"), {"answer": "7"})
    assert (second.done, second.reward, second.correct) == (True, 0.5, True)


@pytest.mark.parametrize("value", ["1.0", True, None, {"reward": 1}, float("nan"),
                                   EnvStep(reward=1.0, done=False),  # not done needs an observation
                                   EnvStep(reward=1.0, done=True, faults="a tool hung")])  # a list of lines
def test_malformed_returns_are_rejected(value):
    with pytest.raises(MalformedStepError):
        as_env_step(value)


def test_numbers_become_final_steps():
    assert as_env_step(3) == EnvStep(3.0, True)


def test_config_checks_name_the_key():
    assert check_environment_config("rlkit.envs.arithmetic.ArithmeticEnv", {"correct_reward": 2.0}) is None
    assert check_environment_config("rlkit.envs.arithmetic.ArithmeticEnv", {"bonus": 1}).startswith("env.bonus:")
    assert check_environment_config("rlkit.envs.math_answers.answers_match", {}) is None  # (response, metadata)
    assert check_environment_config("rlkit.envs.math_answers.extract_answer", {}).startswith("env._target_:")  # 1 arg
    assert check_environment_config("rlkit.envs.math_answers.answers_match", {"x": 1}).startswith("env.x:")
    assert "cannot import" in check_environment_config("no_such_module.Env", {})


class _Typed(Environment):
    """One constructor parameter per kind of annotation the env.* check reads."""

    def __init__(self, *, count: int, scale: float, flag: bool, name: str, limit: int | None, ratio: Optional[float],
                 tags: list[str], options: dict | None, sizes: tuple[int, ...], mode: Literal["fast", "exact"],
                 path: Path, later: "int", loose, sloppy: float = None):
        pass


class _NoConstructor(Environment):
    pass


@pytest.mark.parametrize("key, value", [
    ("count", 3), ("scale", 2), ("scale", 0.5), ("flag", False), ("name", "x"), ("limit", None), ("limit", 4),
    ("ratio", None), ("ratio", 1), ("tags", ["a"]), ("options", {"a": 1}), ("options", None), ("sizes", [1, 2]),
    ("mode", "exact"), ("path", "/tmp"),  # a class annotation is not checked: the constructor may convert
    ("later", 3), ("loose", [1, "a"]), ("sloppy", None)])  # None fits a parameter whose default is None
def test_env_key_of_the_annotated_type_is_accepted(key, value):
    assert check_environment_config(f"{__name__}._Typed", {key: value}) is None


@pytest.mark.parametrize("key, value, expected", [
    ("count", True, "int"), ("count", 2.5, "int"), ("count", "3", "int"), ("scale", "fast", "float"),
    ("scale", False, "float"), ("scale", None, "float"), ("flag", 1, "bool"), ("flag", "true", "bool"),
    ("name", 3, "str"), ("limit", 2.5, "int | None"), ("ratio", "x", "Optional[float]"), ("tags", "a", "list[str]"),
    ("options", [1], "dict | None"), ("sizes", 3, "tuple[int, ...]"), ("mode", "slow", "Literal['fast', 'exact']"),
    ("later", "3", "int")])  # a string annotation is evaluated
def test_env_key_of_another_type_names_key_type_and_value(key, value, expected):
    reason = check_environment_config(f"{__name__}._Typed", {key: value})
    assert reason == (f"env.{key}: {__name__}._Typed takes {expected} (got: {value!r}, of type "
                      f"{type(value).__name__}); give a value of that type")


def test_env_key_for_a_class_without_constructor_is_unknown():
    """object.__init__'s (*args, **kwargs) used to read as "takes any key"; the class takes none."""
    reason = check_environment_config(f"{__name__}._NoConstructor", {"tolerance": 2})
    assert reason.startswith("env.tolerance: unknown key")


def exact_score(response: str, metadata: dict) -> float:
    return float(response.strip() == metadata["answer"])


def test_scoring_function_as_environment():
    env = load_environment(f"{__name__}.exact_score", {})
    assert env.step(conversation("q", " 4"), {"answer": "4"}) == EnvStep(1.0, True)
    assert env.step(conversation("q", "5"), {"answer": "4"}) == EnvStep(0.0, True)


class _Raises:
    def step(self, messages, metadata):
        raise ValueError("bug in user code")


class _Hangs:
    def step(self, messages, metadata):
        time.sleep(5)


class _Garbage:
    def step(self, messages, metadata):
        return "great answer!"


@pytest.mark.parametrize("env, failure, stuck", [(_Raises(), "exception", False), (_Hangs(), "timeout", True),
                                                 (_Garbage(), "malformed", False)])
def test_safe_step_records_failures(env, failure, stuck):
    outcome, executor_stuck = safe_step(env, conversation("q", "a"), {}, 0.5, ThreadPoolExecutor(1))
    assert outcome.step is None and outcome.failure == failure and executor_stuck == stuck
    if failure == "exception":
        assert "ValueError: bug in user code" in outcome.detail


class _SlowToLoad(Environment):
    def setup(self):
        time.sleep(1.0)
        self.loaded = True

    def step(self, messages, metadata):
        return EnvStep(reward=float(self.loaded), done=True)


def test_a_worker_sets_its_environment_up_before_the_timed_steps():
    """What is slow to load (the calculator's tool schemas import transformers, seconds on a
    loaded machine) loads in the worker's constructor, not in its first step's timeout."""
    worker = EnvWorker(f"{__name__}._SlowToLoad", {}, timeout_s=0.5)
    (outcome,), stuck = worker.step_many([(conversation("q", "a"), {})])
    assert outcome.step == EnvStep(1.0, True) and not stuck
    calculator = EnvWorker("rlkit.envs.calculator.CalculatorEnv", {}, timeout_s=0.5).env
    assert "_toolbox" in calculator.__dict__


def test_env_check_command(tmp_path, capsys):
    import json

    from rlkit.cli import main

    data = tmp_path / "samples.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "1+1=", "response": "2", "answer": "2"},
                                                       {"prompt": "1+2=", "response": "4", "answer": "3"}]))
    assert main(["env", "check", "rlkit.envs.arithmetic.ArithmeticEnv", "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "EnvStep(reward=1.0, done=True" in out and "EnvStep(reward=0.0, done=True" in out
    assert "2/2 samples scored, 0 failed" in out
    # a failing environment is shown, with its traceback, and the command exits non-zero
    assert main(["env", "check", f"{__name__}.exact_score", "--data", str(data)]) == 0
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": "q", "response": "a"}))  # no "answer": exact_score raises
    assert main(["env", "check", f"{__name__}.exact_score", "--data", str(broken)]) == 1
    assert "FAILED (exception)" in capsys.readouterr().out


def sleeps_forever(pid_file: str) -> str:
    """Write down its process id, then never return.

    Args:
        pid_file: where to write it
    """
    Path(pid_file).write_text(str(os.getpid()))
    threading.Event().wait()
    return "never"


class _HungTool(ToolEnvironment):
    tool_timeout_s = 1.0

    def tools(self):
        return [sleeps_forever]

    def score(self, answer, metadata):
        return 1.0


def test_a_hung_tool_in_an_env_worker_is_stopped_and_the_step_goes_on(tmp_path):
    """The worker's step answers the call with a timeout error well inside env_runner.timeout_s,
    its tool process killed (not a thread left behind), and the worker steps on."""
    worker = EnvWorker(f"{__name__}._HungTool", {}, timeout_s=30)
    call = json.dumps({"name": "sleeps_forever", "arguments": {"pid_file": str(tmp_path / "pid")}})
    (hung, answered), stuck = worker.step_many([(conversation("q", f"<tool_call>{call}</tool_call>"), {}),
                                                (conversation("q", "42"), {})])
    assert not stuck and hung.failure is None and not hung.step.done
    assert hung.step.counts["tools/timeout"] == 1 and hung.step.tool_messages[0]["content"] == \
        "Error: sleeps_forever did not finish within 1 s."
    assert hung.step.faults == ["tool sleeps_forever did not finish within 1 s (stopped, counted in tools/timeout)"]
    assert not running(int((tmp_path / "pid").read_text()))
    assert answered.step == EnvStep(1.0, True)
