"""The code sandbox, proven limit by limit: each escape attempt fails inside bubblewrap, and the same
snippet run as a plain host process (`outside`) succeeds, so each test could fail. Then the weak mode,
and refusing to start without bubblewrap."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlkit.envs import sandbox
from rlkit.envs.code_execution import CodeExecutionEnv, extract_program
from rlkit.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, max_file_mb=1, processes=16, open_files=32)

needs_bwrap = pytest.mark.skipif(not os.access(sandbox.BWRAP, os.X_OK),
                                 reason=f"bubblewrap not installed ({sandbox.BWRAP}); apt-get install bubblewrap")


def outside(snippet: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The snippet as a plain host process, no sandbox."""
    return subprocess.run([sys.executable, "-c", snippet], cwd=cwd, capture_output=True, text=True, timeout=30)


def processes_of(result) -> list[int]:
    """Live processes from the run whose program printed its working directory first: the scratch
    directory's unique name is in each one's command line."""
    name = os.path.basename(result.stdout.split()[0]).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and name in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            pass  # exited meanwhile
    return pids


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    yield server
    server.close()


@needs_bwrap
def test_runs_a_program_and_removes_its_directory():
    result = run_python("import os\nprint(os.getcwd(), sum(range(10)))\nopen('scratch.txt', 'w').write('x')", LIMITS)
    workdir, total = result.stdout.split()
    assert result.ok and total == "45"
    assert not Path(tempfile.gettempdir(), Path(workdir).name).exists()


@needs_bwrap
def test_network(listener):
    port = listener.getsockname()[1]
    snippet = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()"
    assert not run_python(snippet, LIMITS).ok  # its network namespace has its own, empty, loopback
    with pytest.raises(socket.timeout):
        listener.accept()
    assert outside(snippet).returncode == 0
    listener.accept()[0].close()


@needs_bwrap
def test_write_outside_scratch(tmp_path):
    target = tmp_path / "escaped.txt"
    snippet = f"open({str(target)!r}, 'w').write('x')"
    result = run_python(snippet, LIMITS)
    assert not result.ok and not target.exists()
    assert not run_python("open('/usr/escaped.txt', 'w')", LIMITS).ok  # the system directories: read-only
    assert outside(snippet).returncode == 0 and target.exists()


@needs_bwrap
def test_file_size(tmp_path):
    snippet = "open('big', 'wb').write(b'x' * (2 << 20))"  # 2 MB, over LIMITS.max_file_mb
    result = run_python(snippet, LIMITS)
    assert not result.ok and "File too large" in result.stderr
    assert outside(snippet, cwd=tmp_path).returncode == 0


@needs_bwrap
def test_open_files(tmp_path):
    snippet = "files = [open(f'f{i}', 'w') for i in range(100)]"  # over LIMITS.open_files
    result = run_python(snippet, LIMITS)
    assert not result.ok and "Too many open files" in result.stderr
    assert outside(snippet, cwd=tmp_path).returncode == 0


@needs_bwrap
def test_memory():
    snippet = "block = bytearray(300 << 20)"  # over LIMITS.memory_mb
    result = run_python(snippet, LIMITS)
    assert result.reason == "memory"
    assert outside(snippet).returncode == 0


@needs_bwrap
def test_cpu_time():
    result = run_python("while True:\n    pass", SandboxLimits(wall_s=10, cpu_s=1))
    assert result.reason == "cpu"


@needs_bwrap
def test_wall_clock_leaves_no_process_behind():
    # a parent and its child both sleep; the parent then reaps the child
    snippet = "import os, time\nprint(os.getcwd(), flush=True)\nchild = os.fork()\ntime.sleep({})\nchild and os.wait()"
    start = time.monotonic()
    result = run_python(snippet.format(60), SandboxLimits(wall_s=1.0))
    assert result.reason == "timeout" and time.monotonic() - start < 3
    assert processes_of(result) == []
    assert outside(snippet.format(0.1)).returncode == 0


@needs_bwrap
def test_processes_capped():
    snippet = ("import os, signal\nchildren = []\nfor _ in range(50):\n    pid = os.fork()\n    if pid == 0:\n"
               "        signal.pause()\n    children.append(pid)\nfor pid in children:\n"
               "    os.kill(pid, signal.SIGKILL)\n    os.waitpid(pid, 0)\nprint(len(children))")
    result = run_python(snippet, LIMITS)
    assert not result.ok and "BlockingIOError" in result.stderr  # fork refused past LIMITS.processes
    assert outside(snippet).stdout.strip() == "50"


@needs_bwrap
def test_fork_bomb_is_stopped_and_leaves_no_process_behind():
    bomb = ("import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass")
    start = time.monotonic()
    result = run_python(bomb, SandboxLimits(wall_s=2.0, processes=16))
    assert result.reason == "timeout" and time.monotonic() - start < 5
    assert processes_of(result) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@needs_bwrap
def test_home_directory_is_hidden():
    marker_dir = Path.home() / f".rlkit-sandbox-test-{secrets.token_hex(4)}"
    marker_dir.mkdir()
    try:
        marker = marker_dir / "marker.txt"
        marker.write_text("secret")
        snippet = f"print(open({str(marker)!r}).read())"
        result = run_python(snippet, LIMITS)
        assert not result.ok and "secret" not in result.stdout
        assert marker_dir.name not in run_python(f"import os\nprint(os.listdir({str(Path.home())!r}))", LIMITS).stdout
        assert outside(snippet).stdout.strip() == "secret"
    finally:
        shutil.rmtree(marker_dir)


@needs_bwrap
def test_cannot_kill_a_host_process():
    inside_target, outside_target = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        snippet = "import os, signal\nos.kill({}, signal.SIGKILL)"
        result = run_python(snippet.format(inside_target.pid), LIMITS)
        assert "ProcessLookupError" in result.stderr and inside_target.poll() is None  # not in its PID namespace
        assert outside(snippet.format(outside_target.pid)).returncode == 0
        assert outside_target.wait(timeout=5) == -signal.SIGKILL
    finally:
        for sleeper in (inside_target, outside_target):
            sleeper.kill()
            sleeper.wait()


@needs_bwrap
def test_output_is_truncated():
    result = run_python("print('x' * 200_000)", LIMITS)
    assert result.ok and len(result.stdout) == 65536


@needs_bwrap
def test_code_execution_env():
    env = CodeExecutionEnv(wall_s=3, cpu_s=2, memory_mb=256)
    tests = {"tests": "assert add(2, 3) == 5"}
    good = [{"role": "user", "content": "write add"}, {"role": "assistant",
                                                         "content": "```python\ndef add(a, b):\n    return a + b\n```"}]
    bad = [good[0], {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a - b\n```"}]
    assert env.step(good, tests).reward == 1.0
    assert env.step(bad, tests).reward == 0.0
    assert extract_program("no fences") == "no fences"


# ---- without bubblewrap: refuse, or the weak mode when opted in -------------------------------------


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "BWRAP", str(tmp_path / "no-bwrap"))


@pytest.mark.usefixtures("no_bwrap")
class TestWithoutBubblewrap:
    def test_refuses_with_the_fix(self):
        with pytest.raises(SandboxUnavailable, match=r"apt-get install bubblewrap.*env\.allow_weak_sandbox=true"):
            CodeExecutionEnv()
        with pytest.raises(SandboxUnavailable):
            run_python("print(1)")

    def test_weak_mode_when_opted_in(self, caplog):
        env = CodeExecutionEnv(wall_s=3, cpu_s=2, memory_mb=256, allow_weak_sandbox=True)
        assert "not a security boundary" in caplog.text
        messages = [{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]
        assert env.step(messages, {"tests": "assert add(2, 3) == 5"}).reward == 1.0
        assert env.step(messages, {"tests": "assert add(2, 3) == 6"}).reward == 0.0

    def test_weak_mode_keeps_its_limits(self, tmp_path):
        def weak(source, limits=LIMITS):
            return run_python(source, limits, allow_weak=True)
        assert weak("block = bytearray(300 << 20)").reason == "memory"
        assert weak("while True:\n    pass", SandboxLimits(wall_s=1.0)).reason == "timeout"
        target = tmp_path / "escaped.txt"
        assert "not allowed" in weak(f"open({str(target)!r}, 'w').write('x')").stderr and not target.exists()
        assert "not allowed" in weak("import socket\nsocket.socket()").stderr
        assert "not allowed" in weak("import os\nos.system('true')").stderr
        assert "not allowed" in weak("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))").stderr


CODE_TOOL_ESCAPES = {  # snippet -> what the tool message says; each also runs, unconfined, as a host process
    "network": ("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()", "exit code 1"),
    "write outside its folder": ("open({target!r}, 'w').write('x')", "exit code 1"),
    "memory": ("block = bytearray(300 << 20)", "over 256 MB of memory"),
    "wall clock": ("import time\ntime.sleep(60)", "stopped after 3 s"),
}


@needs_bwrap
@pytest.mark.parametrize("escape", CODE_TOOL_ESCAPES)
def test_the_code_tool_keeps_the_sandbox_limits(escape, listener, tmp_path):
    """run_python offered as a tool: the escapes the code reward stops fail the same way, and the
    model reads why in the tool message (the same snippet succeeds outside the sandbox)."""
    from rlkit.envs.tools import ToolBox, ToolCall
    from rlkit.envs.tools.code import PythonSandbox

    snippet, said = CODE_TOOL_ESCAPES[escape]
    target = tmp_path / "escaped.txt"
    snippet = snippet.format(port=listener.getsockname()[1], target=str(target))
    box = ToolBox([PythonSandbox(LIMITS).run_python], timeout_s=30)
    result = box.call(ToolCall("run_python", {"code": snippet}, ""))
    assert result.failure is None and said in result.content, result.content  # the tool answered, the program failed
    assert not target.exists()
    if escape == "network":
        with pytest.raises(socket.timeout):
            listener.accept()
    if escape != "wall clock":
        assert outside(snippet).returncode == 0


@needs_bwrap
def test_the_code_tool_returns_what_the_program_prints():
    from rlkit.envs.tools import ToolBox, ToolCall
    from rlkit.envs.tools.code import PythonSandbox

    box = ToolBox([PythonSandbox(LIMITS).run_python])
    assert box.schemas[0]["function"]["parameters"]["required"] == ["code"]
    assert box.call(ToolCall("run_python", {"code": "print(sum(range(10)))"}, "")).content == "45\n"
    failed = box.call(ToolCall("run_python", {"code": "1/0"}, "")).content
    assert failed.startswith("[exit code 1]\n") and "ZeroDivisionError" in failed


@pytest.mark.parametrize("key, value", [("memory_mb", -1), ("memory_mb", 0), ("memory_mb", 8), ("wall_s", 0),
                                        ("wall_s", -5), ("wall_s", float("inf")), ("cpu_s", 0), ("processes", 0)])
def test_a_sandbox_limit_that_is_no_limit_is_refused_in_one_line(key, value):
    """memory_mb=-1 used to lift the memory limit (a 2 GiB allocation passed); wall_s, cpu_s or
    processes at 0 made every program fail. Refused with the config, before any worker starts,
    and by the sandbox itself."""
    line = sandbox_env_problem(key, value)
    assert line.startswith(f"env.{key}: must be a finite number >= ") and f"(got: {value!r})" in line, line
    assert "\n" not in line
    with pytest.raises(ValueError, match=f"^sandbox limit {key}: must be"):
        run_python("print(1)", SandboxLimits(**{key: value}))
    from rlkit.envs.tools.code import PythonSandbox
    with pytest.raises(ValueError, match=f"^sandbox limit {key}: must be"):
        PythonSandbox(SandboxLimits(**{key: value}))


def sandbox_env_problem(key: str, value) -> str | None:
    from rlkit.envs.base import check_environment_config

    return check_environment_config("rlkit.envs.code_execution.CodeExecutionEnv",
                                    {key: value, "allow_weak_sandbox": True})


@needs_bwrap
def test_the_least_limits_run_a_program():
    """The documented minimums (sandbox._MINIMUM) are limits a program runs under."""
    least = SandboxLimits(**{key: value for key, value in sandbox._MINIMUM.items() if key != "wall_s"})
    assert sandbox_env_problem("memory_mb", least.memory_mb) is None
    assert run_python("print(sum(range(10)))", least).stdout == "45\n"
