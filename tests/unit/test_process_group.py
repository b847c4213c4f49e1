"""The local cluster's process group (rlkit/cluster/process_group.py): what is started in it is out of
the driver's process group, so a signal to that group (a terminal's Ctrl-C) is the driver's alone, and
it ends with the driver: when the driver stops the group, and when the driver is SIGKILLed, the folder it
was given to remove with it (the cluster's session folder) removed then too."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from rlkit.cluster.process_group import ProcessGroup


def removed(folder: Path) -> bool:
    """Whether folder is gone, waiting a while for the group's remover (it runs once the reaper is gone)."""
    deadline = time.monotonic() + 30
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not folder.exists()


def test_a_member_is_out_of_the_drivers_group_and_stopping_the_group_kills_it(tmp_path):
    group = ProcessGroup()
    member = subprocess.Popen(["sleep", "600"], process_group=group.pgid)
    kept, session = tmp_path / "kept", tmp_path / "session"
    kept.mkdir()
    session.mkdir()
    try:
        assert os.getpgid(member.pid) == group.pgid != os.getpgid(0)
        assert os.getsid(member.pid) == os.getsid(0)  # still the driver's session
        group.removes(kept)
        group.removes(session)  # the last one given (None: none; stop_local_ray keeps a failed run's logs)
    finally:
        group.stop()
    assert member.wait(timeout=30) == -signal.SIGKILL
    assert removed(session) and kept.is_dir()


DRIVER = textwrap.dedent("""\
    import subprocess, sys, time
    from rlkit.cluster.process_group import ProcessGroup
    group = ProcessGroup()
    member = subprocess.Popen(["sleep", "600"], process_group=group.pgid)
    group.removes(sys.argv[1])
    print(member.pid, group.pgid, flush=True)
    time.sleep(600)
""")


def test_the_group_dies_with_a_sigkilled_driver_and_its_folder_is_removed(tmp_path):
    session = tmp_path / "session"
    (session / "logs").mkdir(parents=True)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(session)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        member, reaper = (psutil.Process(int(pid)) for pid in driver.stdout.readline().split())
        os.killpg(driver.pid, signal.SIGKILL)  # the driver's group: the member is not in it
        _, alive = psutil.wait_procs([member, reaper], timeout=30)
        assert not alive and removed(session) and tmp_path.is_dir()
    finally:
        driver.kill()
        driver.wait()
