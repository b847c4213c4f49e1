"""Each sandbox limit, proven: time, memory, filesystem, network; and the directory is removed."""

import socket
import time

from rlkit.envs.code_execution import CodeExecutionEnv, extract_program
from rlkit.envs.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256)


def test_runs_a_program():
    result = run_python("print(sum(range(10)))", LIMITS)
    assert result.ok and result.stdout.strip() == "45"


def test_infinite_loop_is_stopped():
    start = time.monotonic()
    result = run_python("while True:\n    pass", LIMITS)
    assert result.reason in ("cpu", "timeout") and time.monotonic() - start < LIMITS.wall_s + 2


def test_sleeping_program_hits_the_wall_clock():
    result = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0, cpu_s=2, memory_mb=256))
    assert result.reason == "timeout"


def test_memory_bomb_is_stopped():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", LIMITS)
    assert result.reason == "memory"


def test_cannot_write_outside_its_directory(tmp_path):
    target = tmp_path / "escaped.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", LIMITS)
    assert not result.ok and "PermissionError" in result.stderr
    assert not target.exists()


def test_can_write_inside_its_directory():
    assert run_python("open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())", LIMITS).ok


def test_cannot_connect_to_a_local_listener():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(1.0)
    port = listener.getsockname()[1]
    try:
        result = run_python(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))", LIMITS)
        assert not result.ok
        try:
            connection, _ = listener.accept()
            connection.close()
            raise AssertionError("the sandboxed program reached the listener")
        except socket.timeout:
            pass
    finally:
        listener.close()


def test_cannot_start_processes():
    result = run_python("import os\nos.system('true')", LIMITS)
    assert not result.ok and "not allowed" in result.stderr


def test_working_directory_is_removed():
    import os
    result = run_python("import os\nprint(os.getcwd())", LIMITS)
    assert result.ok and not os.path.exists(result.stdout.strip())


def test_code_execution_env():
    env = CodeExecutionEnv(wall_s=3, cpu_s=2, memory_mb=256)
    tests = {"tests": "assert add(2, 3) == 5"}
    good = [{"role": "user", "content": "write add"}, {"role": "assistant",
                                                         "content": "```python\ndef add(a, b):\n    return a + b\n```"}]
    bad = [good[0], {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a - b\n```"}]
    assert env.step(good, tests).reward == 1.0
    assert env.step(bad, tests).reward == 0.0
    assert extract_program("no fences") == "no fences"
