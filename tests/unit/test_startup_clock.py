"""A command's start-up is timed from rlkit's start in its process, not from the process's creation:
a shell execs its last command in its own process, created before whatever the shell ran first
(`bash -c 'setup && rlkit train ...'` once booked the setup's minutes as rlkit's imports)."""

import json
import shlex
import subprocess
import sys

# the driver's clock as `rlkit train` makes it, and the process's age by its creation time (on the
# kernel's clock since boot, to its 10 ms ticks)
PROBE = """
import json, os
from rlkit.observability.startup import StartupClock
clock = StartupClock(from_rlkit_start=True)
created = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
print(json.dumps({"imports": clock.phases["python_imports"], "total": clock.metrics()["timing/startup/total"],
                  "since_created": float(open("/proc/uptime").read().split()[0]) - created}))
"""


def test_start_up_excludes_what_the_shell_ran_before_it_execd_rlkit():
    slept_s = 1
    command = f"sleep {slept_s} && exec {shlex.quote(sys.executable)} -c {shlex.quote(PROBE)}"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    # the process was created before the sleep; what the clock counts began after it
    assert seen["since_created"] - seen["total"] >= slept_s, seen
    assert 0 < seen["imports"] <= seen["total"], seen
