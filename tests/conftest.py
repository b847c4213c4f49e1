"""The order tests run in and, under pytest-xdist (`-n 2`, the README's command), how they are
shared out between the workers.

The fast tier first: tests/unit runs before the tiers that start Ray clusters and workers, so a
failing run says so within minutes. Then the integration tests, the longest first, so that the
workers end close together. A file's tests go to one worker, as they share its module fixtures
and its session's Ray cluster, pool of workers and cache of tiny models and warm starts
(tests/integration/conftest.py)."""

import pytest

# integration files by their time in a full run, longest first (2-core machine, 21 min run); the others follow
LONGEST_FIRST = ("test_algorithms", "test_checkpoint", "test_env_workers", "test_async_grpo", "test_cli",
                 "test_interrupts", "test_pretrained", "test_loopback_cluster", "test_ray_job", "test_two_nodes",
                 "test_tool_episodes", "test_trajectory_flow")
# a file whose tests share little (a 60-step warm start): each test can go to either worker
EACH_TEST_APART = {"tests/integration/test_checkpoint.py"}
# files that use the results of another file's session fixture: they go to the same worker
# (the runs on new workers; SmolLM2 converted once)
BESIDE = {"tests/integration/test_warm_pool.py": "tests/integration/test_grpo_run.py",
          "tests/integration/test_pretrained_grpo.py": "tests/integration/test_pretrained.py"}


def _rank(item) -> tuple[int, int]:
    tier = {"unit": 0, "integration": 1}.get(item.path.parent.name, 2)
    stem = item.path.stem
    return tier, LONGEST_FIRST.index(stem) if tier == 1 and stem in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    items.sort(key=_rank)  # stable: each file keeps its tests' order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        """Whole files, in the collection's order above (not xdist's largest-first)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in EACH_TEST_APART else BESIDE.get(path, path)

    config.option.loadscopereorder = False
    return ByFile(config, log)


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
    terminal = session.config.pluginmanager.getplugin("terminalreporter")
    if session.config.pluginmanager.hasplugin("dsession") and terminal is not None:  # xdist's controller
        session.config.pluginmanager.register(FileStarts(terminal), "file_starts")
