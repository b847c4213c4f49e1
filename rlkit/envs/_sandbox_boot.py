"""Runs inside the sandbox process (python -I -B this_file workdir program.py): installs an
audit hook, which Python code cannot remove, that refuses network access, process creation,
native code loading and any write outside workdir; then runs the program."""

import os
import runpy
import sys

WORKDIR = os.path.realpath(sys.argv[1])
PROGRAM = sys.argv[2]
_DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "ctypes.", "pty.", "os.kill", "signal.")
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


sys.addaudithook(_hook)
sys.argv = [PROGRAM]
runpy.run_path(PROGRAM, run_name="__main__")
