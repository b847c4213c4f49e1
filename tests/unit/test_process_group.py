"""The local cluster's process group (rlkit/cluster/process_group.py): what is started in it is out of
the driver's process group, so a signal to that group (a terminal's Ctrl-C) is the driver's alone, and
it ends with the driver: when the driver stops the group, and when the driver is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from rlkit.cluster.process_group import ProcessGroup


def test_a_member_is_out_of_the_drivers_group_and_stopping_the_group_kills_it():
    group = ProcessGroup()
    member = subprocess.Popen(["sleep", "600"], process_group=group.pgid)
    try:
        assert os.getpgid(member.pid) == group.pgid != os.getpgid(0)
        assert os.getsid(member.pid) == os.getsid(0)  # still the driver's session
    finally:
        group.stop()
    assert member.wait(timeout=30) == -signal.SIGKILL


DRIVER = textwrap.dedent("""\
    import subprocess, time
    from rlkit.cluster.process_group import ProcessGroup
    group = ProcessGroup()
    member = subprocess.Popen(["sleep", "600"], process_group=group.pgid)
    print(member.pid, group.pgid, flush=True)
    time.sleep(600)
""")


def test_the_group_dies_with_a_sigkilled_driver():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        member, reaper = (psutil.Process(int(pid)) for pid in driver.stdout.readline().split())
        os.killpg(driver.pid, signal.SIGKILL)  # the driver's group: the member is not in it
        _, alive = psutil.wait_procs([member, reaper], timeout=30)
        assert not alive
    finally:
        driver.kill()
        driver.wait()
