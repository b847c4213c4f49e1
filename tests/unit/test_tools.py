"""Tools as plain Python: schemas from signatures, tool calls parsed from the model's text, and
every way a call can fail answered with a tool message and counted."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import pytest

from rlkit.algorithms.policy_gradient import load_prompts, prompt_renderer
from rlkit.algorithms.warm_start import episode_example
from rlkit.config.schema import ConfigError
from rlkit.data.prompts import Prompt, PromptRenderer
from rlkit.envs.base import EnvStep, MalformedStepError, as_env_step
from rlkit.envs.calculator import CalculatorEnv
from rlkit.envs.base import check_environment_config
from rlkit.envs.tools import (FAILURES, ParsedTurn, ToolBox, ToolCall, ToolDefinitionError, ToolEnvironment,
                              ToolResult, environment_tools, load_parser, methods_of, tool_metrics, tool_schema,
                              valid_fraction)
from rlkit.launch.preflight import check_prompts
from rlkit.observability.metrics import console_line
from rlkit.launch.config import load_config
from rlkit.models.tiny import build_tokenizer


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def lookup(city: str, unit: Literal["C", "F"] = "C") -> dict:
    """The temperature in a city.

    Args:
        city: the city's name
        unit: degrees Celsius or Fahrenheit
    """
    if city == "Atlantis":
        raise KeyError(f"no such city: {city}")
    return {"city": city, "temperature": 21 if unit == "C" else 70}


class Notebook:
    """A class's public documented methods are its tools; the rest are not."""

    def __init__(self):
        self.notes: list[str] = []

    def write(self, text: str) -> str:
        """Keep a note.

        Args:
            text: what to keep
        """
        self.notes.append(text)
        return f"{len(self.notes)} notes"

    def helper(self, x: int) -> int:
        return x

    def _private(self, x: int) -> int:
        """Not a tool.

        Args:
            x: anything
        """
        return x


def test_schema_from_signature_and_docstring():
    schema = tool_schema(lookup)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "lookup" and function["description"] == "The temperature in a city."
    assert function["parameters"]["required"] == ["city"]
    assert function["parameters"]["properties"] == {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["C", "F"], "description": "degrees Celsius or Fahrenheit"}}
    assert tool_schema(add)["function"]["parameters"]["properties"]["b"] == {"type": "number",
                                                                               "description": "the second number"}


def test_a_class_offers_its_documented_public_methods():
    notebook = Notebook()
    box = ToolBox(methods_of(notebook))
    assert [s["function"]["name"] for s in box.schemas] == ["write"]
    assert box.schemas[0]["function"]["parameters"]["required"] == ["text"]  # self is not a parameter
    assert box.call(ToolCall("write", {"text": "hi"}, "")).content == "1 notes"
    # the tool's state lives in the tool process (one per toolbox, kept between calls), not in this one
    assert box.call(ToolCall("write", {"text": "ho"}, "")).content == "2 notes" and notebook.notes == []
    box.process.stop()


def test_an_undescribable_tool_is_refused_when_declared():
    def no_docs(x: int) -> int:
        return x

    def untyped(x):
        """Untyped.

        Args:
            x: anything
        """

    for fn in (no_docs, untyped):
        with pytest.raises(ToolDefinitionError, match=rf"^tool {fn.__name__}: .*give it a type hint on every"):
            ToolBox([fn])


HERMES = load_parser("hermes")


def test_parser_reads_well_formed_calls_and_the_text_around_them():
    turn = HERMES.parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
                        '<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    assert turn == ParsedTurn("Let me add.", [
        ToolCall("add", {"a": 2, "b": 3}, '{"name": "add", "arguments": {"a": 2, "b": 3}}'),
        ToolCall("lookup", {"city": "Oslo"}, '{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}')])
    assert HERMES.parse("The answer is 5.") == ParsedTurn("The answer is 5.", [])


@pytest.mark.parametrize("text, kind, reason", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', "malformed", "not valid JSON"),
    ('<tool_call>{"arguments": {"a": 2}}</tool_call>', "malformed", 'expected {"name"'),
    ('<tool_call>["add", 2]</tool_call>', "malformed", 'expected {"name"'),
    ('<tool_call>{"name": "add", "arguments": [2, 3]}</tool_call>', "malformed", "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{a: 2}"}</tool_call>', "malformed", "arguments are not valid JSON"),
    ('Sure. <tool_call>{"name": "add", "argum', "partial", "cut off before </tool_call>"),
])
def test_parser_names_what_is_wrong_with_a_call(text, kind, reason):
    call, = HERMES.parse(text).calls
    assert call.kind == kind and reason in call.error


def test_an_unknown_parser_is_named():
    with pytest.raises(ToolDefinitionError, match="unknown tool-call parser 'xml'.*'hermes'"):
        load_parser("xml")


def hangs(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


BOX = ToolBox([add, lookup, hangs], timeout_s=0.5)


@pytest.mark.parametrize("text, failure, message", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', "malformed",
     "Error: the tool call could not be read: not valid JSON"),
    ('<tool_call>{"name": "add", "arg', "partial", "Error: the tool call could not be read: the call was cut off"),
    ('<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>', "unknown_tool",
     "Error: there is no tool named 'divide'; the tools are add, hangs, lookup."),
    ('<tool_call>{"name": "add", "arguments": {"b": 1}}</tool_call>', "bad_arguments",
     "Error: add(a: int, b: float = 1.0) -> float: missing a required argument: 'a'."),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "c": 2}}</tool_call>', "bad_arguments",
     "got an unexpected keyword argument 'c'"),
    ('<tool_call>{"name": "add", "arguments": {"a": "two"}}</tool_call>', "bad_arguments",
     "a must be int (got 'two')"),
    ('<tool_call>{"name": "lookup", "arguments": {"city": "Oslo", "unit": "K"}}</tool_call>', "bad_arguments",
     "unit must be Literal['C', 'F'] (got 'K')"),
    ('<tool_call>{"name": "lookup", "arguments": {"city": "Atlantis"}}</tool_call>', "raised",
     "Error: lookup raised KeyError: 'no such city: Atlantis'"),
    ('<tool_call>{"name": "hangs", "arguments": {"seconds": 30}}</tool_call>', "timeout",
     "Error: hangs did not finish within 0.5 s."),
])
def test_every_failure_becomes_a_tool_message_and_a_count(text, failure, message):
    result = BOX.call(HERMES.parse(text).calls[0])
    assert result.failure == failure and message in result.content
    assert result.message()["role"] == "tool" and result.message()["content"] == result.content
    metrics = tool_metrics([result, BOX.call(ToolCall("add", {"a": 2}, ""))])
    assert metrics["tools/calls"] == 2 and metrics["tools/returned"] == 1
    assert valid_fraction(metrics) == {"tools/valid_fraction": 0.5} and valid_fraction({}) == {}
    assert metrics[f"tools/{failure}"] == 1 and sum(metrics[f"tools/{k}"] for k in FAILURES) == 1


def test_a_call_that_returns_gives_its_value_as_text():
    assert BOX.call(ToolCall("add", {"a": 2, "b": 0.5}, "")).content == "2.5"
    assert BOX.call(ToolCall("add", {"a": 2}, "")).failure is None  # an int where a float is taken: fine
    assert BOX.call(ToolCall("lookup", {"city": "Oslo", "unit": "F"}, "")).content == \
        '{"city": "Oslo", "temperature": 70}'
    long = ToolBox([lookup], max_result_chars=10).call(ToolCall("lookup", {"city": "Oslo"}, ""))
    assert long.content.startswith('{"city": "') and long.content.endswith("more characters]")


def hangs_with_a_child(pid_file: str) -> str:
    """Start a subprocess, write down both process ids, and never return.

    Args:
        pid_file: where to write them
    """
    child = subprocess.Popen(["sleep", "600"])
    Path(pid_file).write_text(f"{os.getpid()} {child.pid}")
    threading.Event().wait()
    return "never"


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (one killed whose parent has not reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def gone_soon(pid: int) -> bool:
    """A killed process is gone within seconds (SIGKILL is delivered asynchronously)."""
    for _ in range(100):
        if not running(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_hung_tool_is_killed_with_what_it_started_and_the_next_call_runs(tmp_path):
    box = ToolBox([hangs_with_a_child, add], timeout_s=1)
    pid_file = tmp_path / "pids"
    result = box.call(ToolCall("hangs_with_a_child", {"pid_file": str(pid_file)}, ""))
    assert result.failure == "timeout" and result.content == "Error: hangs_with_a_child did not finish within 1 s."
    assert result.fault == "tool hangs_with_a_child did not finish within 1 s (stopped, counted in tools/timeout)"
    tool_pid, its_child = map(int, pid_file.read_text().split())
    assert tool_pid != os.getpid() and not running(tool_pid)  # killed and reaped: no thread or process left
    assert gone_soon(its_child)  # the tool's own subprocess: killed with its process group
    assert box.call(ToolCall("add", {"a": 1}, "")).content == "2.0"  # in a fresh tool process
    assert box.process.pid not in (None, tool_pid)
    box.process.stop()


def test_calls_from_two_threads_get_their_own_replies():
    """A step abandoned at env_runner.timeout_s may still be in a call when the next step makes one."""
    box = ToolBox([hangs, add], timeout_s=1)
    with ThreadPoolExecutor(2) as pool:
        hung = pool.submit(box.call, ToolCall("hangs", {"seconds": 30}, ""))
        added = pool.submit(box.call, ToolCall("add", {"a": 1}, ""))
        assert hung.result().failure == "timeout" and added.result().content == "2.0"
    box.process.stop()


KILLED_WORKER = """
import os, subprocess, sys, threading
from pathlib import Path
from rlkit.envs.tools import ToolBox, ToolCall

def hangs(pid_file: str) -> str:
    \"\"\"Start a subprocess, write down both process ids, and never return.

    Args:
        pid_file: where to write them
    \"\"\"
    child = subprocess.Popen(["sleep", "600"])
    Path(pid_file).write_text(f"{os.getpid()} {child.pid}")
    threading.Event().wait()

ToolBox([hangs], timeout_s=600).call(ToolCall("hangs", {"pid_file": sys.argv[1]}, ""))
"""


def test_a_killed_worker_takes_its_tool_process_along(tmp_path):
    """A worker killed mid-call (ray.kill of a stuck environment worker) leaves no tool process
    behind, nor what the tool started."""
    pid_file = tmp_path / "pids"
    worker = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, str(pid_file)])
    try:
        for _ in range(600):  # the tool has started (seconds on a loaded machine)
            if pid_file.exists() and len(pid_file.read_text().split()) == 2:
                break
            time.sleep(0.05)
        tool_pid, its_child = map(int, pid_file.read_text().split())
        assert running(tool_pid) and running(its_child)
    finally:
        worker.kill()
        worker.wait()
    assert gone_soon(tool_pid) and gone_soon(its_child)


def exits(code: int) -> str:
    """End the process.

    Args:
        code: its exit status
    """
    os._exit(code)


def test_a_tool_that_raises_or_ends_its_process_is_a_fault_in_one_line():
    box = ToolBox([lookup, exits, add])
    raised = box.call(ToolCall("lookup", {"city": "Atlantis"}, ""))
    assert raised.content == "Error: lookup raised KeyError: 'no such city: Atlantis'"
    assert re.fullmatch(r"tool lookup raised KeyError: 'no such city: Atlantis' \(test_tools.py:\d+\)", raised.fault)
    ended = box.call(ToolCall("exits", {"code": 3}, ""))
    assert ended.failure == "raised" and ended.fault == "tool exits raised nothing: its process ended with exit code 3"
    assert box.call(ToolCall("add", {"a": 1}, "")).content == "2.0"
    box.process.stop()


class Calculator(ToolEnvironment):
    """Multiplies with a tool; scores the final answer."""

    def tools(self):
        return [multiply]

    def score(self, answer, metadata):
        return EnvStep(reward=float(answer == metadata["answer"]), done=True, correct=answer == metadata["answer"])


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


def test_a_tool_environment_answers_calls_and_scores_the_answer():
    env = Calculator()
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["multiply"]
    step = as_env_step(env.step([{"role": "assistant", "content": CALL + CALL.replace("12", "2")}], {"answer": "408"}))
    assert not step.done and step.reward == 0.0
    assert step.tool_messages == [{"role": "tool", "name": "multiply", "content": "408"},
                                  {"role": "tool", "name": "multiply", "content": "68"}]
    assert step.counts["tools/calls"] == 2 and step.counts["tools/returned"] == 2
    bad = env.step([{"role": "assistant", "content": '<tool_call>{"name": "divide"}</tool_call>'}], {"answer": "408"})
    assert bad.counts["tools/unknown_tool"] == 1 and "no tool named 'divide'" in bad.tool_messages[0]["content"]
    final = env.step([{"role": "assistant", "content": "408"}], {"answer": "408"})
    assert final.done and final.reward == 1.0 and final.correct


@pytest.mark.parametrize("step, problem", [
    (EnvStep(0.0, False, tool_messages=[]), "non-empty list"),
    (EnvStep(0.0, False, tool_messages=[{"role": "user", "content": "x"}]), "non-empty list"),
    (EnvStep(0.0, False, tool_messages=[{"role": "tool", "content": 5}]), "non-empty list"),
    (EnvStep(0.0, False, observation="x", tool_messages=[{"role": "tool", "content": "5"}]), "give one"),
    (EnvStep(0.0, False), "needs a string observation"),
])
def test_a_malformed_tool_step_is_named(step, problem):
    with pytest.raises(MalformedStepError, match=problem):
        as_env_step(step)


def test_token_in_token_out_a_three_turn_tool_trajectory():
    """Two tool calls and an answer: the trajectory is the prompt's ids, the engine's own ids for
    each model turn and the template's rendering of each tool result, and together they are the
    template's rendering of the whole conversation. Appended turns never depend on how the
    model's text would be re-tokenized: the same turn sampled as other tokens gets the same
    appended ids."""
    tokenizer = build_tokenizer()
    schemas = Calculator().tool_schemas()
    renderer = PromptRenderer(tokenizer, True, None, "{prompt}", "{observation}", tools=schemas)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    messages = [{"role": "user", "content": "What is 12*34+2*34?"}]
    trajectory = renderer.prompt_ids(messages)
    turns = [("The answer needs a tool. " + CALL, "408"), (CALL.replace("12", "2"), "68"), ("476", None)]
    for text, result in turns:
        generated = ids(text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]  # the engine stops after end-of-turn
        trajectory += generated
        messages.append({"role": "assistant", "content": text})
        if result is not None:
            tool_turn = [{"role": "tool", "name": "multiply", "content": result}]
            appended = renderer.appended_ids(generated, tool_turn)
            trajectory += appended
            messages += tool_turn
            # one character per token, not as the tokenizer splits "answer": the same appended ids
            retokenized = [i for ch in text for i in ids(ch)] + generated[-1:]
            assert renderer.appended_ids(retokenized, tool_turn) == appended
            assert retokenized != generated or "answer" not in text
    whole = ids(tokenizer.apply_chat_template(messages, tokenize=False, tools=schemas))
    assert whole == trajectory + ids("\n")  # the template ends the last turn with a newline the model did not write
    assert "<tool_response>\n408\n</tool_response>" in tokenizer.decode(trajectory)


def test_the_prompts_show_the_environment_tools(tmp_path):
    """env=calculator: the chat template lists its tools before the first user turn; a template
    that ignores tools, or raw prompts, are refused before any worker starts."""
    cfg, _ = load_config("grpo_tiny_cpu", ["env=calculator", "env_runner.max_turns=3", "data.chat_template=true",
                                           f"run.cache_dir={tmp_path}"])
    schemas = environment_tools(cfg.env)
    assert [s["function"]["name"] for s in schemas] == ["add", "subtract", "multiply"]
    assert environment_tools({"_target_": "rlkit.envs.arithmetic.ArithmeticEnv"}) is None
    tokenizer = build_tokenizer()
    prompt = tokenizer.decode(load_prompts(cfg, tokenizer).train[0].token_ids)
    assert prompt.startswith("<|im_start|>system\nTools: add(a,b) subtract(a,b) multiply(a,b). Call: <tool_call>")
    raw, _ = load_config("grpo_tiny_cpu", ["env=calculator", "data.chat_template=false", f"run.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^data.chat_template: rlkit.envs.calculator.CalculatorEnv offers tools, "
                                          r"but raw prompts .* set data.chat_template=true"):
        load_prompts(raw, tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="the tokenizer's chat template ignores them"):
        load_prompts(cfg, tokenizer)


def test_word_problems_with_a_calculator_are_scored_as_math_answers():
    """env=math_calculator: a call gets its result as a tool message; the answer turn is checked
    as env=math checks it (math-verify on "#### n"), with its format reward."""
    from rlkit.envs.calculator import MathCalculatorEnv

    env = MathCalculatorEnv(format_reward=0.1)
    metadata = {"answer": "She has 12 + 30 = 42 apples.\n#### 42"}
    called = env.step([{"role": "assistant", "content": CALL}], metadata)
    assert not called.done and called.tool_messages[0]["content"] == "408"
    right = env.step([{"role": "assistant", "content": "12 + 30 = 42\n#### 42"}], metadata)
    wrong = env.step([{"role": "assistant", "content": "#### 41"}], metadata)
    assert (right.reward, right.correct, right.done) == (1.1, True, True)
    assert (wrong.reward, wrong.correct) == (0.1, False)
    assert env.reference_response(metadata) == "#### 42"


# ChatML that ignores tools= and renders a tool message under its own role, as SmolLM2's template does
TOOLLESS_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_go_into_the_system_message_for_a_template_that_ignores_them(tmp_path):
    """data.tool_prompt=system_prompt: rlkit writes the tools' schemas and the call format the
    parser reads into the system message (after data.system_prompt), and tool results are
    appended as the template renders a tool message, token in, token out."""
    cfg, _ = load_config("grpo_tiny_cpu", ["env=calculator", "env_runner.max_turns=2", "data.chat_template=true",
                                           "data.tool_prompt=system_prompt", "data.system_prompt=Be exact.",
                                           "data.max_prompt_tokens=4096",  # the tiny tokenizer spells JSON out
                                           f"run.cache_dir={tmp_path}"])
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOLLESS_CHATML
    prompt = load_prompts(cfg, tokenizer).train[0]
    system = prompt.messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be exact.\n\nYou can call these tools")
    for schema in environment_tools(cfg.env):
        assert json.dumps(schema, separators=(",", ":")) in system["content"]
    assert tokenizer.decode(prompt.token_ids).startswith("<|im_start|>system\nBe exact.\n\nYou can call")
    # the format the system message teaches is the one the environment parses
    call = re.search(r"<tool_call>.*</tool_call>", system["content"]).group(0)
    assert call.startswith('<tool_call>{"name": "<tool>"') and "arguments" in call
    renderer = prompt_renderer(cfg, tokenizer)
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    appended = renderer.appended_ids(tokenizer(CALL, add_special_tokens=False)["input_ids"] + end,
                                     [{"role": "tool", "name": "multiply", "content": "408"}])
    assert tokenizer.decode(appended) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ConfigError, match=r"^data.tool_prompt: must be one of"):
        load_config("grpo_tiny_cpu", ["data.tool_prompt=prompt"])


def test_the_readme_tool_example_works():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = textwrap.dedent(re.search(r"```python\n(\s*from rlkit.envs.tools import ToolEnvironment\n.*?)```", readme,
                                     re.DOTALL).group(1))
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    env = namespace["Calculator"]()
    step = env.step([{"role": "assistant", "content": CALL}], {"answer": "408"})
    assert step.tool_messages == [{"role": "tool", "name": "multiply", "content": "408"}]
    assert env.step([{"role": "assistant", "content": "408"}], {"answer": "408"}).reward == 1.0


def test_a_warm_start_example_is_a_whole_tool_episode(tmp_path):
    """CalculatorEnv's reference turns for "37*58=": the call, then the answer, each trained on
    and ended with EOS; the tool's result between them as the environment answers it, not trained
    on: the tokens a run would append."""
    cfg, _ = load_config("grpo_tiny_cpu", ["env=calculator", "data.chat_template=true", f"run.cache_dir={tmp_path}"])
    tokenizer = build_tokenizer()
    renderer = prompt_renderer(cfg, tokenizer)
    messages = [{"role": "user", "content": "37*58="}]
    prompt = Prompt(messages, renderer.prompt_ids(messages), {"answer": "2146"})
    env = CalculatorEnv()
    ids, trained = episode_example(env, renderer, tokenizer.eos_token_id)(prompt)
    call = '<tool_call>{"name":"multiply","arguments":{"a":37,"b":58}}</tool_call>'
    assert env.reference_turns(messages, prompt.metadata) == [call, "2146"]
    trained_text = tokenizer.decode([i for i, t in zip(ids, trained) if t])
    assert trained_text == call + "<|endoftext|>2146<|endoftext|>"
    assert tokenizer.decode(ids[len(prompt.token_ids):]) == (
        call + "<|endoftext|><|im_end|>\n<|im_start|>user\n<tool_response>\n2146\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n2146<|endoftext|>")
    assert ids[:len(prompt.token_ids)] == prompt.token_ids and not any(trained[:len(prompt.token_ids)])
    assert env.reference_turns([{"role": "user", "content": "what?"}], {"answer": "1"}) is None


class _Tools(ToolEnvironment):
    """A tool environment whose tools, parser and time limit each test sets."""

    offered = [add]

    def tools(self):
        return self.offered

    def score(self, answer, metadata):
        return 0.0


class NoDocstring(_Tools):
    offered = [add, lambda a: a]


class NotAFunction(_Tools):
    offered = [add, 42]


class SameNameTwice(_Tools):
    offered = [add, add, lookup]


class UnknownParser(_Tools):
    parser = "xml"


class NoTimeLimit(_Tools):
    tool_timeout_s = 0


@pytest.mark.parametrize("target, kwargs, problem", [
    (f"{__name__}.NoDocstring", {}, rf"env._target_: {__name__}.NoDocstring.tools\(\): tool <lambda>: "
                                    r".*no docstring.*; give it a type hint on every parameter and a docstring"),
    (f"{__name__}.NotAFunction", {}, rf"env._target_: {__name__}.NotAFunction.tools\(\): 42 is not a function "
                                     r"\(got: int\); offer functions or bound methods"),
    (f"{__name__}.SameNameTwice", {}, rf"env._target_: {__name__}.SameNameTwice.tools\(\): two tools are named add "
                                      r"\(got: add, add, lookup\); give each tool a name of its own"),
    (f"{__name__}.UnknownParser", {}, rf"env._target_: {__name__}.UnknownParser.parser: unknown tool-call parser "
                                      r"'xml' .*; use one of \['hermes'\] or an importable class path"),
    (f"{__name__}.NoTimeLimit", {}, rf"env._target_: {__name__}.NoTimeLimit.tool_timeout_s: must be a finite number "
                                    r"of seconds > 0 \(got: 0\); set the seconds one tool call may take"),
    ("rlkit.envs.calculator.CalculatorEnv", {"tool_timeout_s": 0}, r"env.tool_timeout_s: .* \(got: 0\)"),
    ("rlkit.envs.calculator.CalculatorEnv", {"tool_timeout_s": -1}, r"env.tool_timeout_s: .* \(got: -1\)"),
    ("rlkit.envs.calculator.CalculatorEnv", {"tool_timeout_s": float("inf")}, r"env.tool_timeout_s: .* \(got: inf\)"),
])
def test_each_tool_definition_problem_is_one_line_naming_the_key(target, kwargs, problem):
    """Checked with the config (env._target_'s check), before any worker starts."""
    line = check_environment_config(target, kwargs)
    assert re.match(problem, line) and "\n" not in line, line


def test_the_config_refuses_a_tool_definition_problem_before_any_worker_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"^env.tool_timeout_s: must be a finite number of seconds > 0 \(got: -1\)"):
        load_config("grpo_tiny_cpu_tools", ["env.tool_timeout_s=-1", f"run.cache_dir={tmp_path}"])


def test_tool_failures_are_on_the_console_line():
    results = [ToolResult("hangs", "", "timeout")] * 3 + [ToolResult("lookup", "", "raised"), ToolResult("add", "2")]
    metrics = {"train/reward": 0.0, "env/failures": 0, **tool_metrics(results), "timing/step": 3.0}
    line = console_line(2, 10, metrics, 3.0)
    assert line.endswith("| env_fail 0 | time 3.00s | tool_fail 4/5 (raised 1, timeout 3)"), line
    assert console_line(2, 10, {**metrics, **tool_metrics([ToolResult("add", "2")])}, 3.0).endswith("tool_fail 0/1")
    assert "tool_fail" not in console_line(2, 10, {"train/reward": 0.0}, 3.0)  # no tool environment


def test_a_budget_too_small_for_any_tool_call_is_named_in_the_first_lines(tmp_path, caplog):
    """The shortest call (hermes, the calculator's add with a=0, b=0) does not fit in 8 tokens:
    every call would be cut off (tools/partial) and answered with an error; with one turn, a
    call's result is never followed by an answer; a step time limit not above the tool's would
    stop a hung tool's whole step first."""
    tokenizer = build_tokenizer()

    def warnings(*overrides: str) -> list[str]:
        cfg, _ = load_config("grpo_tiny_cpu_tools", [*overrides, f"run.cache_dir={tmp_path}"])
        caplog.clear()
        check_prompts(cfg, load_prompts(cfg, tokenizer), tokenizer)
        return [r.getMessage() for r in caplog.records if "tool" in r.getMessage()]

    assert warnings() == []  # the recipe's budgets hold a call and the answer after it
    (small,) = warnings("generation.max_new_tokens=8")
    assert small.startswith("generation.max_new_tokens: 8 tokens cannot hold even the shortest tool call of "
                            "env._target_=rlkit.envs.calculator.CalculatorEnv ('<tool_call>{\"name\": \"add\", "
                            "\"arguments\": {\"a\": 0, \"b\": 0}}</tool_call>': "), small
    (one_turn,) = warnings("env_runner.max_turns=1")
    assert one_turn.startswith("env_runner.max_turns: 1 turn leaves none to answer after a tool call"), one_turn
    (step_first,) = warnings("env.tool_timeout_s=10", "env_runner.timeout_s=10")
    assert step_first.startswith("env_runner.timeout_s: 10s is not above the tool time limit of "
                                 "env._target_=rlkit.envs.calculator.CalculatorEnv (10s): a hung tool times out its "
                                 "whole step"), step_first
