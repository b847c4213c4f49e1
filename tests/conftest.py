"""The order tests run in and, under pytest-xdist (`-n 2`, the README's command), how they are
shared out between its two processes.

Alone, pytest runs tests/unit first, so a failing run says so within minutes rather than after
the slow tiers. Under xdist one process runs tests/integration, in its files' order as alone, and
the other runs tests/unit (then the GPU tier, skipped on a CPU machine) beside it. The integration
tests stay in one process: they share its Ray cluster and pool of workers, and many start a local
cluster of their own, whose raylet must register within Ray's fixed 30 s; with integration tests
in both processes the two cores were loaded enough that some did not."""

import os

import pytest

INTEGRATION = "tests/integration/"


def pytest_collection_modifyitems(items):
    # under xdist the integration tier is queued first, so one process takes it at once (ByTier)
    first = "integration" if "PYTEST_XDIST_WORKER" in os.environ else "unit"
    items.sort(key=lambda item: item.path.parent.name != first)  # stable: each tier keeps its order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByTier(LoadScopeScheduling):
        """tests/integration as one unit of work; every other file a unit of its own."""

        def _split_scope(self, nodeid: str) -> str:
            return INTEGRATION if nodeid.startswith(INTEGRATION) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # in the collection's order, not the largest unit first
    return ByTier(config, log)


class FileStarts:
    """Under pytest-xdist the progress is dots alone: a line names each file as its first test
    starts, and the process it runs in."""

    def __init__(self, terminal):
        self.terminal, self.started = terminal, set()

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        if report.when == "setup" and path not in self.started and hasattr(report, "node"):
            self.started.add(path)
            if self.terminal._tw.width_of_current_line:  # after dots: a line of its own
                self.terminal.write("\n")
            self.terminal.write_line(f"[{report.node.gateway.id}] {path}")


def pytest_sessionstart(session):
    terminal = session.config.pluginmanager.getplugin("terminalreporter")
    if session.config.pluginmanager.hasplugin("dsession") and terminal is not None:  # xdist's controller
        session.config.pluginmanager.register(FileStarts(terminal), "file_starts")
