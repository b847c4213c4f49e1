"""`rlkit env check`: every mistake in its arguments is one stderr line naming the argument, exit code 2;
a user call that hangs is reported failed, and the command still exits. The argument cases run main()
in-process (a subprocess each would cost seconds of imports); one case and the hang run the real command."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlkit
from rlkit.cli import main

REPO_ROOT = Path(rlkit.__file__).resolve().parents[1]
TARGET = "rlkit.envs.arithmetic.ArithmeticEnv"
# data files by name; "{tmp}" in the cases below is the folder they are written to
DATA = {"bad.jsonl": '{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+2=", \n',
        "no_response.jsonl": json.dumps({"prompt": "1+1=", "answer": "2"}),
        "object.json": json.dumps({"prompt": "1+1=", "response": "2"}),
        "bad_messages.jsonl": json.dumps({"messages": "2"}),
        "empty.jsonl": "\n"}

# (id, arguments after `env check`, how stderr's one line starts after "rlkit: config error: ")
MISTAKES = [
    ("data-missing", [TARGET, "--data", "{tmp}/missing.jsonl"], "--data: cannot read {tmp}/missing.jsonl"),
    ("data-not-json", [TARGET, "--data", "{tmp}/bad.jsonl"], "--data: {tmp}/bad.jsonl line 2 is not valid JSON"),
    ("data-no-response", [TARGET, "--data", "{tmp}/no_response.jsonl"], "--data: sample 0 of {tmp}/no_response.jsonl"),
    ("data-not-a-list", [TARGET, "--data", "{tmp}/object.json"], "--data: {tmp}/object.json holds no list of samples"),
    ("data-bad-messages", [TARGET, "--data", "{tmp}/bad_messages.jsonl"], "--data: sample 0 of"),
    ("data-empty", [TARGET, "--data", "{tmp}/empty.jsonl"], "--data: {tmp}/empty.jsonl holds no list of samples"),
    ("target-not-importable", ["nosuchmodule.Env"], "env._target_: cannot import 'nosuchmodule.Env'"),
    ("target-neither-env-nor-function", ["os.path"], "env._target_: os.path is neither"),
    ("kwargs-not-json", [TARGET, "--kwargs", "{bad"], "--kwargs: not valid JSON"),
    ("kwargs-not-an-object", [TARGET, "--kwargs", "[1]"], "--kwargs: must be a JSON object"),
    ("kwargs-unknown-key", [TARGET, "--kwargs", '{"bonus": 1}'], "env.bonus: unknown key"),
    ("kwargs-wrong-type", [TARGET, "--kwargs", '{"correct_reward": "high"}'],
     f"env.correct_reward: {TARGET} takes float (got: 'high', of type str)"),
    ("timeout-not-positive", [TARGET, "--timeout-s", "0"], "--timeout-s: must be > 0"),
]


@pytest.mark.parametrize("args, expected", [c[1:] for c in MISTAKES], ids=[c[0] for c in MISTAKES])
def test_argument_mistake_is_one_line_naming_it(tmp_path, capsys, args, expected):
    for name, text in DATA.items():
        (tmp_path / name).write_text(text)
    code = main(["env", "check", *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1, f"stderr should be one line: {err!r}"
    assert err.startswith(f"rlkit: config error: {expected.replace('{tmp}', str(tmp_path))}"), err


def env_check(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """The command in a process of its own, with this checkout's rlkit (and modules in cwd) importable."""
    path = os.pathsep.join(p for p in [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")] if p)
    return subprocess.run([sys.executable, "-m", "rlkit.cli", "env", "check", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, "PYTHONPATH": path})


def test_command_exits_2_with_one_line(tmp_path):
    result = env_check([TARGET, "--data", "missing.jsonl"], tmp_path, timeout_s=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == ["rlkit: config error: --data: cannot read missing.jsonl (No such file or "
                                          "directory); give a .jsonl or .json file of samples"]


def test_hung_call_is_reported_failed_and_the_command_exits(tmp_path):
    """The call sleeps 60 s: exiting well before that shows the abandoned call's thread is not waited for at exit
    (15 s leaves the imports room on a busy machine). Before, the command printed its summary and then hung."""
    (tmp_path / "hangs.py").write_text("import time\n\n\ndef score(response, metadata):\n    time.sleep(60)\n"
                                       "    return 1.0\n")
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    start = time.monotonic()
    result = env_check(["hangs.score", "--data", "one.jsonl", "--timeout-s", "1"], tmp_path, timeout_s=30)
    assert time.monotonic() - start < 15
    assert result.returncode == 1, result.stderr
    assert "FAILED (timeout)" in result.stdout and "hangs.score: 0/1 samples scored, 1 failed" in result.stdout


def test_a_tool_environment_is_stepped_at_every_assistant_turn(tmp_path):
    """A transcript's tool calls are answered turn by turn and its answer scored; a malformed call
    gets its error back as the tool message, not a failed sample."""
    result = env_check(["rlkit.envs.calculator.CalculatorEnv"], tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "    turn 2: multiply -> '408'" in lines
    assert any(line.startswith("    turn 4: EnvStep(reward=1.0, done=True") for line in lines)
    assert any(line.startswith("    turn 2: call -> 'Error: the tool call could not be read: not valid JSON")
               for line in lines)
    assert lines[-1] == "rlkit.envs.calculator.CalculatorEnv: 2/2 samples scored, 0 failed"
