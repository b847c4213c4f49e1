"""A process group of the driver's session, not the driver's own group, for the processes the driver
starts and stops itself: a local Ray cluster's GCS, raylet, agents and workers.

In the driver's own group they would get every signal sent to that group, a terminal's Ctrl-C (SIGINT)
and `kill -- -PGID` or a batch system's cancel (SIGTERM): the GCS and raylet end at a SIGTERM, in the
middle of the step the driver is finishing and checkpointing, and the driver then waits for the dead
GCS. In a group of their own the signal is the driver's alone to handle; it stops them as it ends.
The group is led by a reaper (this file, run on its own) that waits on a pipe only the driver writes
to and then kills the group: when the driver ends, however it ends (a SIGKILL included), nothing in
the group outlives it (Ray's agents would wait a minute on the GCS that died with the driver), and
the folder the group was given to remove with it (the cluster's session folder: Ray leaves every one
behind) goes too. Linux and macOS. Imports the standard library alone: the reaper starts in 30 ms."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


class ProcessGroup:
    """A group of the driver's session led by a reaper; `process_group=group.pgid` puts a process started
    with subprocess.Popen in it."""

    def __init__(self):
        reaper_end, self._lifeline = os.pipe()  # the driver's end: close-on-exec, no process it starts has it
        self._reaper = subprocess.Popen([sys.executable, "-I", "-S", __file__], stdin=reaper_end, process_group=0)
        os.close(reaper_end)
        self.pgid = self._reaper.pid
        self._folder: Path | None = None

    def removes(self, folder: Path | None) -> None:
        """As the group is killed (by stop(), or as the driver ends), folder is removed too (None: none)."""
        self._folder = folder
        os.write(self._lifeline, f"{folder or ''}\n".encode())

    def stop(self) -> None:
        """Kill what is still in the group (the processes stopped before are gone from it), then remove
        its folder."""
        if self._lifeline >= 0:
            os.write(self._lifeline, b"\n")  # removed here, once the group is gone
            os.close(self._lifeline)
            self._lifeline = -1
        self._reaper.wait()
        if self._folder is not None:
            remove(self._folder)
            self._folder = None


def remove(folder: Path) -> None:
    """folder, and a link beside it to it (Ray's session_latest)."""
    shutil.rmtree(folder, ignore_errors=True)
    for link in folder.parent.glob("*"):
        if link.is_symlink() and os.readlink(link) == str(folder):
            link.unlink(missing_ok=True)


def _reap() -> None:
    """The reaper: reads its standard input, the pipe, until EOF (the driver's end closed); its last line
    is the folder to remove ("": none). Then kills its group, itself included; the folder's remover, in
    a session of its own, waits until then: for EOF on a pipe whose other end only the reaper holds."""
    folder = ""
    for line in sys.stdin:
        folder = line.rstrip("\n")
    if folder:
        remover_end, reaper_end = os.pipe()  # reaper_end: open until the kill below ends this process
        subprocess.Popen([sys.executable, "-I", "-S", __file__, folder], stdin=remover_end, start_new_session=True)
        os.close(remover_end)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    if len(sys.argv) == 1:
        _reap()
    else:  # the remover
        sys.stdin.read()
        remove(Path(sys.argv[1]))
