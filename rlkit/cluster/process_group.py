"""A process group of the driver's session, not the driver's own group, for the processes the driver
starts and stops itself: a local Ray cluster's GCS, raylet, agents and workers.

In the driver's own group they would get every signal sent to that group, a terminal's Ctrl-C (SIGINT)
and `kill -- -PGID` or a batch system's cancel (SIGTERM): the GCS and raylet end at a SIGTERM, in the
middle of the step the driver is finishing and checkpointing, and the driver then waits for the dead
GCS. In a group of their own the signal is the driver's alone to handle; it stops them as it ends.
The group is led by a reaper, a shell that waits on a pipe only the driver writes to and then kills
the group: when the driver ends, however it ends (a SIGKILL included), nothing in the group outlives
it (Ray's agents would wait a minute on the GCS that died with the driver). Linux and macOS."""

import os
import subprocess

# reads its standard input, the pipe, until EOF (the driver's end closed), then kills its group, itself included
REAPER = "read _; kill -KILL 0"


class ProcessGroup:
    """A group of the driver's session led by a reaper; `process_group=group.pgid` puts a process started
    with subprocess.Popen in it."""

    def __init__(self):
        reaper_end, self._lifeline = os.pipe()  # the driver's end: close-on-exec, no process it starts has it
        self._reaper = subprocess.Popen(["sh", "-c", REAPER], stdin=reaper_end, process_group=0)
        os.close(reaper_end)
        self.pgid = self._reaper.pid

    def stop(self) -> None:
        """Kill what is still in the group (the processes stopped before are gone from it)."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        self._reaper.wait()
