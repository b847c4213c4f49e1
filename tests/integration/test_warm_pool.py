"""Worker processes kept between runs (rlkit/cluster/warm_pool.py): a run on workers that already
ran another one gives exactly what a run on fresh workers gives and starts no process; an idle
worker that died is replaced by a new process; a run that fails gives back none of its workers;
an idle Megatron worker holds no process group and no model."""

import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
from conftest import THREE_GRPO_STEPS, ModelWorkerPool

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.cluster.setup import start_workers
from rlkit.cluster.warm_pool import WarmPool
from rlkit.data.batch import Batch, batch_totals
from rlkit.launch.run import train
from rlkit.models.resolve import resolve_model_dir

pytestmark = pytest.mark.integration

def without_timings(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in metrics.items() if not k.startswith("timing/")} for metrics in history]


def test_a_run_on_reused_workers_equals_one_on_fresh_workers(grpo_on_new_workers, warm_pool, make_cfg):
    fresh = grpo_on_new_workers("colocated")
    # the session pool's workers (those of earlier tests, or started here) first run another seed
    # and layout, then the run under test
    train(*make_cfg(*THREE_GRPO_STEPS, "run.seed=7", "cluster.placement=disaggregated", "run.name=pool_first"),
          pool=warm_pool)
    started = warm_pool.size
    reused = train(*make_cfg(*THREE_GRPO_STEPS, "run.name=pool_second"), pool=warm_pool)
    assert warm_pool.size == started  # the second run started no process
    assert without_timings(reused.history) == without_timings(fresh.history)


def test_an_idle_worker_found_dead_is_replaced_and_a_failed_runs_workers_are_killed(ray_cluster, make_cfg):
    cfg, _ = make_cfg("policy.num_workers=1", "generation.num_workers=1")
    model_dir = str(resolve_model_dir(cfg))
    pool = WarmPool()
    try:
        first = start_workers(cfg, model_dir, pool=pool)
        policy, generation = first.policy.workers.actors[0], first.generation.workers.actors[0]
        first.shutdown()
        assert pool.size == 2
        os.kill(ray._private.state.actors()[policy._actor_id.hex()]["Pid"], signal.SIGKILL)  # idle, it dies
        second = start_workers(cfg, model_dir, pool=pool)
        assert second.generation.workers.actors == [generation]  # reused
        assert second.policy.workers.actors != [policy] and pool.size == 2  # a new process in the dead one's place
        batch = Batch({"input_ids": torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0))})
        assert torch.isfinite(second.policy.logprobs(batch)[:, 1:]).all()
        actors = second.policy.workers.actors + second.generation.workers.actors
        second.shutdown(failed=True)
        assert pool.size == 0
        for actor in actors:
            assert _dies_within(actor, 60)
    finally:
        pool.shutdown()


def _dies_within(actor, seconds: float) -> bool:
    """Whether the actor is dead within `seconds`: ray.kill returns before the actor ends, and a
    call that reaches it first is still answered."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.startup_phases.remote(), timeout=seconds)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.5)
    return False


def _process_group_and_gloo_threads(worker) -> tuple[bool, int]:
    """Whether the worker is in a process group, and how many gloo threads its process runs."""
    def look(_):
        import torch.distributed as dist

        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
            except FileNotFoundError:  # a thread that ended since the listing
                pass
        return dist.is_initialized(), sum(name.startswith(("pt_gloo", "gloo_")) for name in names)

    return ray.get(worker.__ray_call__.remote(look), timeout=60)


def test_an_idle_policy_worker_holds_no_process_group(warm_pool, make_cfg):
    """Given back, a Megatron worker leaves its process groups and frees them at once, however many
    runs it served (in the session's pool, those of the tests before this one): idle, it runs none
    of their gloo threads, which keep waking up (kept, they cost idle workers several percent of a
    core each, more with every run). Each run here does a forward, whose rotary embeddings
    megatron-core caches with their process group."""
    cfg, _ = make_cfg("policy.num_workers=2", "generation.num_workers=1")
    model_dir = str(resolve_model_dir(cfg))
    batch = Batch({"input_ids": torch.randint(0, 300, (4, 6), generator=torch.Generator().manual_seed(0))})
    sizes = []
    for _ in range(3):
        run = start_workers(cfg, model_dir, pool=warm_pool)
        run.policy.logprobs(batch)
        policy = run.policy.workers.actors[0]
        in_group, threads_in_run = _process_group_and_gloo_threads(policy)
        run.shutdown()
        still_in_group, threads_idle = _process_group_and_gloo_threads(policy)
        print(f"gloo threads: {threads_in_run} in the run, {threads_idle} idle")
        assert in_group and not still_in_group
        assert threads_in_run > 0 and threads_idle == 0
        sizes.append(warm_pool.size)
    assert sizes[0] == sizes[1] == sizes[2]  # the same workers each time


def test_an_idle_worker_keeps_no_model_of_an_moe_run(warm_pool, make_cfg):
    """Given back after an MoE training step, a Megatron worker keeps no model. megatron-core's
    token dispatcher keeps its last routing probs, whose autograd graph reaches the gradient hooks
    of the DDP wrapper: a cycle through autograd's C++ nodes that no garbage collection frees,
    which kept the whole model of every MoE run a pooled worker had trained."""
    cfg, _ = make_cfg("policy.model_path=tiny://qwen3_moe", "policy.num_workers=1", "policy.micro_batch_size=4")
    workers = ModelWorkerPool(warm_pool)
    policy = workers.start(cfg, resolve_model_dir(cfg))
    input_ids = torch.randint(0, 300, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(input_ids.shape)
    mask[:, 0] = 0
    policy.train(Batch({"input_ids": input_ids, "loss_mask": mask}), batch_totals(mask), NextTokenNLL())
    worker = policy.workers.actors[0]
    assert _models_held(worker) == 1
    workers.release()
    assert _models_held(worker) == 0


def _models_held(worker) -> int:
    """The DDP-wrapped model chunks alive in the worker's process, after a full collection."""
    def look(_):
        import gc

        from megatron.core.distributed import DistributedDataParallel

        gc.collect()
        return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())

    return ray.get(worker.__ray_call__.remote(look), timeout=60)
