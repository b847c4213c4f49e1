"""A run's output, when it goes to a file, is plain text: the "(Worker pid=...)" prefix Ray's
driver prints before each worker line carries no colour codes, and Ray's advice on the token
authentication it turns on for a new cluster is not printed for the loopback cluster rlkit starts.
Ray's own printing and warning functions are called; no cluster is started."""

import io
import logging
import sys
from types import SimpleNamespace

import pytest
import ray
from ray._private import worker
from ray._private.authentication import authentication_token_setup

from rlkit.cluster import ray_runtime
from rlkit.config.schema import ClusterConfig

CLUSTER = ClusterConfig(address=None, connect_timeout_s=10.0, num_cpus=1, object_store_mb=100, placement="colocated",
                        threads_per_worker=1, call_timeout_s=60.0, collective_timeout_s=60.0,
                        fork_workers=False)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def token_log():
    """What Ray's token-authentication module logs."""
    handler, logger = Records(), logging.getLogger(authentication_token_setup.__name__)
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def worker_line(line: str) -> str:
    out = io.StringIO()
    worker.print_worker_logs({"pid": 1234, "task_name": "f", "lines": [line], "ip": "127.0.0.1",
                              "localhost": "127.0.0.1", "is_err": False}, out)
    return out.getvalue()


def test_local_cluster_output_to_a_file_is_plain(monkeypatch, token_log):
    monkeypatch.setenv("RAY_COLOR_PREFIX", "")  # recorded, so the setting the run makes is undone after
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # e.g. `rlkit train ... > run.log`
    assert "\x1b[" in worker_line("hello")  # Ray's default, which the run must turn off

    authentication_token_setup._warn_token_auth_enabled()
    assert token_log and token_log[0].startswith("Token authentication is enabled")  # the handler sees it
    token_log.clear()
    # ray.init of a new cluster, as far as this goes: its token warning
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: authentication_token_setup._warn_token_auth_enabled())
    monkeypatch.setattr(worker, "_global_node", SimpleNamespace(kill_dashboard=lambda check_alive: None))
    assert ray_runtime.join_or_start_ray(CLUSTER, "mbridge")

    assert token_log == []
    assert worker_line("hello") == "(f pid=1234) hello\n"
    authentication_token_setup._warn_token_auth_enabled()  # past the start, Ray's logging is left as it was
    assert len(token_log) == 1


def test_a_colour_setting_of_the_users_own_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(worker, "_global_node", SimpleNamespace(kill_dashboard=lambda check_alive: None))
    ray_runtime.join_or_start_ray(CLUSTER, "mbridge")
    assert "\x1b[" in worker_line("hello")
