"""The fast tier first: tests/unit runs before the tiers that start Ray clusters and workers, so a
failing run says so within minutes rather than after the slow tests.

Under pytest-xdist (`-n 2`, the README's command) one worker runs the integration tests, in this
order, and the other the unit tests beside them: the integration tests share one Ray cluster, pool
of workers and cache per session, and two of them training at once on a small machine would starve
the clusters their commands start."""

import gc
import os

import pytest


def pytest_collection_finish(session):
    # what collection imported is never garbage: the session's full collections (one per several
    # runs, and pytest's own at its end) need not walk it again
    gc.enable()
    gc.freeze()


def pytest_runtest_setup(item):
    """Under pytest-xdist the unit tests' process (and what it starts) runs at SCHED_IDLE: it takes
    the cores only while the integration tests' runs leave them idle (their drivers' serial parts),
    instead of taking a core from those runs' workers (Ray's, at nice 15) for its first minutes."""
    unit = item.path.parent.name == "unit"
    if "PYTEST_XDIST_WORKER" in os.environ and unit != (os.sched_getscheduler(0) == os.SCHED_IDLE):
        os.sched_setscheduler(0, os.SCHED_IDLE if unit else os.SCHED_OTHER, os.sched_param(0))


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.parent.name != "unit")  # stable: each tier keeps its order


# Integration files and tests run apart from the shared stream: each test a unit of work of its
# own, handed out after the unit tests (collection order), so the process that ran those runs them
# beside the shared integration tests instead of idling. Three files start Ray clusters of their
# own (subprocesses); the multi-turn GRPO test, the suite's longest (about 80 s), uses the session's
# cluster and worker pool, which that process then sets up for itself, and so can RLOO's learning test
# (about 15 s): the shared stream is the one that ends last
APART = {"tests/integration/test_interrupts.py", "tests/integration/test_ray_job.py",
         "tests/integration/test_quiet_console.py",
         "tests/integration/test_env_workers.py::test_multi_turn_grpo_improves",
         "tests/integration/test_algorithms.py::test_reinforce_pp_and_rloo_raise_the_reward[rloo_tiny_cpu]"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationApart(LoadScopeScheduling):
        """The integration tests one unit of work, every other test a unit of its own; xdist hands
        out the largest unit first, so the integration tests start at once."""

        def _split_scope(self, nodeid: str) -> str:
            apart = nodeid in APART or nodeid.split("::", 1)[0] in APART or nodeid.split("[", 1)[0] in APART
            shared = nodeid.startswith("tests/integration/") and not apart
            return "integration" if shared else nodeid

    return IntegrationApart(config, log)


class FileStarts:
    """Under pytest-xdist the progress is dots alone: a line names each file as its first test
    starts, and the worker it runs on."""

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
    if session.config.pluginmanager.hasplugin("dsession"):  # xdist's controller: it collects nothing
        terminal = session.config.pluginmanager.getplugin("terminalreporter")
        if terminal is not None:
            session.config.pluginmanager.register(FileStarts(terminal), "file_starts")
    else:  # collection imports torch, Ray and the rest: full collections as the heap grows find nothing
        gc.disable()
