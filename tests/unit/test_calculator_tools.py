"""The word-problem tool environments (rlkit/envs/calculator.py): the calculator's exact divide,
whose refusal is the model's to read, never a fault; and MathCodeEnv, a Python sandbox as the
tool, its limits checked with the config."""

import re
import subprocess
import sys
import textwrap

import pytest

from rlkit.envs.base import check_environment_config
from rlkit.envs.calculator import MathCalculatorEnv, MathCodeEnv
from rlkit.envs.tools import ToolBox, ToolCall
from rlkit.launch.config import load_config

SOLUTION = "15 * 94 = <<15*94=1410>>1410\n1410 / 30 = <<1410/30=47>>47\nMax has 47 stickers now.\n#### 47"


def calls(*arguments: tuple[int, int]) -> str:
    return "".join(f'<tool_call>{{"name": "divide", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
                   for a, b in arguments)


def test_divide_is_exact_and_refuses_a_remainder_as_bad_arguments():
    """Run by the environment's ToolBox in its tool process: an exact quotient comes back; a
    remainder or a zero divisor is a tool message and counts as bad_arguments, with no fault for
    env_runner.fail_fast to stop the run on."""
    env = MathCalculatorEnv()
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "subtract", "multiply", "divide"]
    step = env.step([{"role": "assistant", "content": calls((1410, 30), (7, 2), (8, 0), (-12, 4))}],
                    {"answer": SOLUTION})
    assert not step.done and step.faults is None
    assert [m["content"] for m in step.tool_messages] == [
        "47", "Error: divide(a: int, b: int) -> int: 7 / 2 is not a whole number (remainder 1).",
        "Error: divide(a: int, b: int) -> int: cannot divide by 0.", "-3"]
    assert step.counts["tools/calls"] == 4 and step.counts["tools/returned"] == 2
    assert step.counts["tools/bad_arguments"] == 2 and step.counts["tools/raised"] == 0


def test_a_tool_that_raises_otherwise_is_still_a_fault():
    """Only ToolArgumentError is the model's mistake; any other exception stays the tool's."""

    def broken(a: int) -> int:
        """Fail.

        Args:
            a: anything
        """
        raise ValueError(f"bug at {a}")

    result = ToolBox([broken]).call(ToolCall("broken", {"a": 1}, ""))
    assert result.failure == "raised" and result.fault.startswith("tool broken raised ValueError: bug at 1")


def test_the_code_environment_runs_its_reference_calls_in_the_sandbox():
    env = MathCodeEnv(wall_s=5.0)
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["run_python"]
    first_call, second_call, answer = env.reference_turns([], {"answer": SOLUTION})
    assert second_call == '<tool_call>{"name": "run_python", "arguments": {"code": "print(1410 // 30)"}}</tool_call>'
    step = env.step([{"role": "assistant", "content": second_call}], {"answer": SOLUTION})
    assert step.tool_messages == [{"role": "tool", "name": "run_python", "content": "47\n"}]
    final = env.step([{"role": "assistant", "content": answer}], {"answer": SOLUTION})
    assert final.done and final.correct


@pytest.mark.parametrize("kwargs, problem", [
    ({"memory_mb": 1}, r"^env.memory_mb: must be a finite number >= 32 \(got: 1\)"),
    ({"wall_s": 0}, r"^env.wall_s: must be a finite number >= 0.1 \(got: 0\)"),
    ({"wall_s": 8.0, "tool_timeout_s": 8.0}, r"^env.tool_timeout_s: must exceed env.wall_s \(8\), .* \(got: 8\); "
                                             r"e.g. env.wall_s \+ 5"),
    ({"tool_timeout_s": 0}, r"^env.tool_timeout_s: must be a finite number of seconds > 0 \(got: 0\)"),
])
def test_the_code_environment_refuses_a_limit_in_one_line(kwargs, problem):
    message = check_environment_config("rlkit.envs.calculator.MathCodeEnv", kwargs)
    assert message is not None and re.match(problem, message), message


def test_both_word_problem_environments_load_from_their_config_groups():
    for group, cls in [("math_calculator", MathCalculatorEnv), ("math_calculator_code", MathCodeEnv)]:
        cfg, _ = load_config("grpo_tiny_cpu", [f"env={group}", "data=word_problems_hard", "data.chat_template=true",
                                               "env_runner.max_turns=5"])
        target, kwargs = cfg.env["_target_"], {k: v for k, v in cfg.env.items() if k != "_target_"}
        assert target == f"rlkit.envs.calculator.{cls.__name__}" and check_environment_config(target, kwargs) is None


def test_a_process_that_stepped_the_calculator_under_a_signal_handler_exits():
    """The warm start steps the environment in the run's own process, under the run's SIGTERM
    handler; the tool process forked there must not keep that handler, or the run hangs at its
    exit (multiprocessing stops a daemon child with SIGTERM, then waits for it)."""
    program = textwrap.dedent(f"""
        import signal
        from rlkit.envs.calculator import MathCalculatorEnv
        signal.signal(signal.SIGTERM, lambda *_: None)
        step = MathCalculatorEnv().step([{{"role": "assistant", "content": {calls((8, 2))!r}}}], {{"answer": "4"}})
        print(step.tool_messages[0]["content"])
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr[-2000:]


def test_closing_the_environment_stops_its_tool_process():
    """The warm start closes the environment it stepped on the driver: its forked tool process
    would otherwise hold the driver's pipes (the run's process-group lifeline) until the run ends,
    and the run's end waits for that lifeline to close."""
    env = MathCalculatorEnv()
    env.step([{"role": "assistant", "content": calls((8, 2))}], {"answer": "4"})
    child = env.toolbox.process.process
    assert child.is_alive()
    env.close()
    assert not child.is_alive() and env.toolbox.process.pid is None
    assert env.step([{"role": "assistant", "content": calls((9, 3))}], {"answer": "3"}).tool_messages[0]["content"] == "3"
    env.close()
