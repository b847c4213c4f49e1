"""The sandbox's launcher (sandbox.py): `python -I -B _sandbox_boot.py SETTINGS_JSON PROGRAM`, the first
code to run inside it. Sets the rlimits (here, in the child: a preexec_fn is unsafe in the threaded
processes environments run in), switches to the sandbox's own uid when given one, which drops the
capabilities bwrap left it, installs the audit hook in the weak mode, then runs PROGRAM as __main__
from its directory, in this same interpreter.

The audit hook, which Python code cannot remove, refuses network access, process creation, native
code loading, changing rlimits and any write outside the program's directory. It is what the weak
mode has instead of bubblewrap's namespaces, and is not a security boundary."""

import json
import os
import resource
import runpy
import sys

SETTINGS = json.loads(sys.argv[1])
PROGRAM = sys.argv[2]
WORKDIR = os.path.realpath(os.path.dirname(PROGRAM))
_DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "ctypes.", "pty.", "os.kill", "signal.", "resource.")
_PATH_EVENTS = {"os.remove", "os.rename", "os.replace", "os.mkdir", "os.rmdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move",
                "shutil.copyfile", "shutil.copytree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _inside(path) -> bool:
    if isinstance(path, int):
        return True  # an already-open descriptor
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    return os.path.realpath(os.fspath(path)).startswith(WORKDIR + os.sep)


def _hook(event: str, args: tuple):
    if event.startswith(_DENIED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & _WRITE_FLAGS)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
    elif event in _PATH_EVENTS:
        for arg in args:
            if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg):
                raise PermissionError(f"sandbox: {event} on {arg!r} outside the working directory is not allowed")


for name, (soft, hard) in SETTINGS["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
if SETTINGS["uid"] is not None:
    uid = SETTINGS["uid"]
    os.setgroups([])  # groups and gid first: changing the uid gives up the right to change them
    os.setgid(uid)
    os.setuid(uid)
os.chdir(WORKDIR)
if SETTINGS["audit_hook"]:
    sys.addaudithook(_hook)
sys.argv = [PROGRAM]
runpy.run_path(PROGRAM, run_name="__main__")
