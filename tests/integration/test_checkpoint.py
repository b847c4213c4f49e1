"""Checkpoints: a run killed with SIGKILL at any moment resumes to exactly the metrics of an
uninterrupted run, a LoRA run from checkpoints of its adapters alone; dist checkpoints load into
another TP layout; HF export (a LoRA run's as an HF PEFT adapter); a dead worker is a clear error
naming it and the step, and the last checkpoint still resumes."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from process_tree import ProcessTree
from ray._common.utils import get_default_ray_temp_dir
from run_metrics import last_logged_step
from transformers import AutoModelForCausalLM

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.checkpoint import MANIFEST, CheckpointManager, CheckpointWriteError, verify
from rlkit.cli import main
from rlkit.cluster.worker_group import WorkerError
from rlkit.config.schema import ConfigError
from rlkit.data.batch import Batch, batch_totals
from rlkit.launch.config import load_config
from rlkit.launch.run import train

pytestmark = pytest.mark.integration
RUN = ["algorithm.num_steps=6", "checkpoint.every=2", "algorithm.val_every=3", "algorithm.prompts_per_step=8",
       "policy.train_global_batch_size=64", "algorithm.warm_start.sft_steps=60", "algorithm.kl_coef=0.01",
       "policy.optimizer.lr_schedule=cosine", "policy.optimizer.warmup_steps=2", "policy.optimizer.min_lr_ratio=0.1",
       "logger.plots=false"]


def compared(metrics_file) -> dict[int, dict]:
    """Per step, every metric except wall-clock timings (which no two runs share)."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith("timing/")
                        and k != "refit/buckets"} for r in rows}


def run_in_process(warm_pool, recipe: str, out_dir, cache_dir, run=tuple(RUN)) -> dict[int, dict]:
    """train_command's run, to its end (or, after a kill, resumed to its end), in this process on
    the pool's workers: test_warm_pool shows a run on reused workers equals one on new ones, and
    what a resume restores comes from the checkpoint either way. The runs the tests kill are
    commands of their own. Returns compared() of its metrics."""
    cfg, resolved = load_config(recipe, [*run, f"run.output_dir={out_dir}", f"run.cache_dir={cache_dir}"])
    return compared(train(cfg, resolved, pool=warm_pool).run_dir / "metrics.jsonl")


def train_command(out_dir, cache_dir, *extra, recipe="grpo_tiny_cpu", run=tuple(RUN)):
    return [sys.executable, "-m", "rlkit.cli", "train", "--config-name", recipe, *run,
            f"run.output_dir={out_dir}", f"run.cache_dir={cache_dir}", *extra]


@pytest.fixture(scope="module")
def reference_run(warm_pool, tmp_path_factory, cache_dir):
    """The same run uninterrupted, in this process on the session's cluster (the numbers do not
    depend on which cluster runs it)."""
    return run_in_process(warm_pool, "grpo_tiny_cpu", tmp_path_factory.mktemp("uninterrupted"), cache_dir)


def kill_when(command, condition, point: str, log: Path, timeout_s=300, worker: str = "MegatronModelWorker"):
    """Start the command as its own process group (its output appended to log), SIGKILL the group
    once condition() holds (the driver and the local Ray cluster it started, whose `worker` processes
    train the model); then nothing the run started (Ray's processes and workers, and any process a
    worker started) may remain, nor its Ray session folder."""
    with open(log, "ab") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    deadline, started = time.monotonic() + timeout_s, ProcessTree(process.pid)
    while not condition():
        assert process.poll() is None, f"the run ended before the kill point ({point}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"kill point never reached ({point})"
        time.sleep(0.005)
    started.look(sockets=False)  # quick, so the kill lands at its point; what ended before needs no check
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert any(worker in line for _, line in started.processes.values()), point
    assert started.still_alive() == [], f"left running after a SIGKILL {point}"
    while session_folders(process.pid) and time.monotonic() < deadline:  # removed once the cluster's group is gone
        time.sleep(0.05)
    assert session_folders(process.pid) == [], f"Ray's session folder left after a SIGKILL {point}"


def session_folders(driver_pid: int) -> list[Path]:
    """The Ray session folders a driver made (Ray names them after its pid)."""
    return list(Path(get_default_ray_temp_dir()).glob(f"session_*_{driver_pid}"))


def test_sigkill_at_any_moment_then_resume_matches_uninterrupted(reference_run, warm_pool, tmp_path, cache_dir):
    """One run killed with SIGKILL at each point in turn and started again with the same command
    each time ends with exactly the metrics of an uninterrupted run: killed before its first
    checkpoint (after step 1; it starts over), then while step 4's checkpoint is being written,
    two steps past the last complete one (step 2's: it resumes from there, discards the partial
    write and trains steps 3 and 4 again)."""
    # the KL reference is the starting policy: exactly 0 before the first update
    assert reference_run[1]["train/reference_kl"] == 0.0
    # the warm start gives rewards to learn from: every step moves the weights that resume must restore
    assert all(reference_run[step]["train/grad_norm"] > 0.1 for step in range(1, 7))
    run_dir = tmp_path / "grpo_tiny_cpu"
    checkpoints = run_dir / "checkpoints"
    kill_points = {
        "after step 1": lambda: last_logged_step(run_dir) >= 1,
        "while step 4's checkpoint is written": lambda: checkpoints.is_dir() and any(
            p.name.startswith("step_000004.tmp-") for p in checkpoints.iterdir()),
    }
    lrs = [reference_run[step]["train/lr"] for step in range(1, 7)]  # one optimizer step per step
    assert lrs[0] < lrs[1] == lrs[2] > lrs[3] > lrs[5] == pytest.approx(0.1 * lrs[1])  # warmup, then cosine decay
    for point, condition in kill_points.items():
        kill_when(train_command(tmp_path, cache_dir), condition, point, tmp_path / "run.log")
    # the second kill left step 4's write unfinished beside step 2's complete checkpoint
    names = sorted(p.name for p in checkpoints.iterdir())
    assert len(names) == 2 and names[0] == "step_000002" and names[1].startswith("step_000004.tmp-"), names
    assert run_in_process(warm_pool, "grpo_tiny_cpu", tmp_path, cache_dir) == reference_run
    assert not any(".tmp-" in p.name for p in checkpoints.iterdir())  # the interrupted write was discarded
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["step_000004", "step_000006"]  # keep_last 2


def reserved_and_staged(policy) -> list[tuple[int | None, int, int]]:
    """Per rank: the bytes reserved ahead for the first checkpoint's host copies (None: nothing
    reserved), the bytes of them handed out, and the bytes of every host copy staged."""
    def probe(worker):  # a nested function travels by value: the workers cannot import this module
        save = worker.checkpoints.background_save
        return (None if save.block is None else save.block.numel(), save.block_used,
                sum(copy.numel() * copy.element_size() for copy in save.staging.values()))

    return ray.get([actor.__ray_call__.remote(probe) for actor in policy.workers.actors])


def test_dist_checkpoint_loads_into_another_tensor_parallel_size(model_workers, make_cfg, tiny_qwen2, tmp_path):
    batch = Batch({"input_ids": torch.randint(0, 300, (8, 10), generator=torch.Generator().manual_seed(1))})
    saved = {}
    for name, layout in [("tp1", ["policy.num_workers=2"]),
                         ("tp2", ["policy.num_workers=2", "policy.tensor_parallel_size=2"])]:
        cfg, _ = make_cfg(*layout, "policy.micro_batch_size=4")
        policy = model_workers.start(cfg, tiny_qwen2)
        if name == "tp1":
            mask = torch.ones(8, 10)
            policy.train(batch.with_fields(loss_mask=mask), batch_totals(mask), NextTokenNLL())
            policy.save_checkpoint(str(tmp_path), "dist")
            policy.finish_checkpoint(wait=True)
            # data-parallel rank 0 writes the state: its copies came out of the block it reserved
            # after the optimizer step; the other rank writes nothing and reserved nothing
            (reserved, used, staged), other = reserved_and_staged(policy)
            assert staged > 0 and used >= staged and reserved - used < 0.01 * reserved  # sized to what it writes
            assert other == (None, 0, 0)
        else:
            policy.load_checkpoint(str(tmp_path), "dist")
        saved[name] = policy.logprobs(batch)
    assert (saved["tp1"] - saved["tp2"]).abs().max().item() < 1e-5


def test_a_lora_run_killed_with_sigkill_resumes_exactly_from_its_adapter_checkpoints(warm_pool, tmp_path_factory,
                                                                                     cache_dir, capsys):
    """grpo_tiny_lora_cpu killed after step 3 and started again ends with exactly the metrics of the
    same run uninterrupted: its checkpoints hold the adapters and their optimizer state, and the base
    is the cached warm start they record. `rlkit convert` turns the last one into an HF PEFT
    adapter that peft loads over that base, and with --merged into the merged model (both by the
    CLI's main in this process, on the session's cluster: a command's own start-up is the one above)."""
    from peft import PeftModel

    killed = tmp_path_factory.mktemp("lora_killed")
    reference = run_in_process(warm_pool, "grpo_tiny_lora_cpu", tmp_path_factory.mktemp("lora_uninterrupted"),
                               cache_dir)
    assert all(reference[step]["train/grad_norm"] > 0 for step in range(1, 7))
    run_dir = killed / "grpo_tiny_lora_cpu"
    command = train_command(killed, cache_dir, recipe="grpo_tiny_lora_cpu")
    kill_when(command, lambda: last_logged_step(run_dir) >= 3, "after step 3", killed / "run.log")
    assert run_in_process(warm_pool, "grpo_tiny_lora_cpu", killed, cache_dir) == reference

    last = run_dir / "checkpoints" / "step_000006"
    base = json.loads((last / "policy" / "base.json").read_text())["hf_dir"]
    base_bytes = sum(path.stat().st_size for path in Path(base).glob("*.safetensors"))
    # a checkpoint of every weight holds the base and Adam's two moments of it: three times base_bytes
    assert sum(path.stat().st_size for path in (last / "policy").rglob("*") if path.is_file()) < base_bytes / 2
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    capsys.readouterr()
    assert main(["convert", str(last), str(killed / "adapter")]) == 0
    assert main(["convert", "--merged", str(last), str(killed / "merged")]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("HF ")]  # not the workers' logs
    assert [re.sub(r" \(\d+ files, [\d.]+ MB\)$", "", line) for line in said] == [
        f"HF PEFT adapter written to {killed / 'adapter'}",
        f"HF checkpoint (the base with the adapters merged in) written to {killed / 'merged'}"]
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), killed / "adapter").eval()
        converted = {"adapter": peft_model(tokens).logits,
                     "merged": AutoModelForCausalLM.from_pretrained(killed / "merged")(tokens).logits,
                     "base": AutoModelForCausalLM.from_pretrained(base)(tokens).logits}
    assert (converted["adapter"] - converted["merged"]).abs().max().item() < 1e-4
    assert (converted["adapter"] - converted["base"]).abs().max().item() > 1e-3  # the adapters trained


# calculator calls over two turns: the warm start teaches the call (the per-trajectory flow's
# resume: tests/integration/test_async_grpo.py), not yet the right answers, so the rewards are 0
# and the weights stay: what this resume must restore is the episodes' (sampling, tool calls,
# data order); that a resume restores moved weights and optimizer state is the test above's.
# (An entropy bonus to move them, even at 0.001, undoes the tool calls within three steps.)
# grpo_tiny_cpu_tools' warm start cut to 60 steps of 32 episodes, its cache entry shared with test_tool_episodes
TOOLS_WARM_START = ("algorithm.warm_start.sft_steps=60", "algorithm.warm_start.batch_size=32", "policy.micro_batch_size=8")
# no validation: what a resume restores is the training steps' episodes (100 validation episodes of two
# turns at step 0, before any kill, cost each of the two starts more than a step)
TOOLS_RUN = ("algorithm.num_steps=4", "checkpoint.every=2", "algorithm.val_every=100",
             "algorithm.val_before_training=false", "algorithm.prompts_per_step=2",
             "policy.train_global_batch_size=16", *TOOLS_WARM_START, "logger.plots=false")


def test_a_tool_run_killed_with_sigkill_resumes_exactly(warm_pool, tmp_path_factory, cache_dir):
    """grpo_tiny_cpu_tools (tool calls parsed and run, their results appended as tool messages)
    killed after step 3 and started again ends with exactly the metrics of the same run
    uninterrupted, the tool-call counts and rewards included."""
    killed = tmp_path_factory.mktemp("tools_killed")
    reference = run_in_process(warm_pool, "grpo_tiny_cpu_tools", tmp_path_factory.mktemp("tools_uninterrupted"),
                               cache_dir, run=TOOLS_RUN)
    assert all(reference[step]["tools/calls"] > 0 for step in range(1, 5))  # the warm start taught the call
    run_dir = killed / "grpo_tiny_cpu_tools"
    command = train_command(killed, cache_dir, recipe="grpo_tiny_cpu_tools", run=TOOLS_RUN)
    kill_when(command, lambda: last_logged_step(run_dir) >= 3, "after step 3", killed / "run.log")
    assert run_in_process(warm_pool, "grpo_tiny_cpu_tools", killed, cache_dir, run=TOOLS_RUN) == reference


def test_distributed_optimizer_resumes_exactly(model_workers, make_cfg, tiny_qwen2, tmp_path):
    """The GPU layout's optimizer (sharded over data-parallel ranks, no Apex/TransformerEngine)
    round-trips through a dist checkpoint: the step after loading equals the step never stopped.
    The checkpoint is written in the background while that next step changes every weight and
    moment in place: what it holds is the state at the save."""
    batch = Batch({"input_ids": torch.randint(0, 300, (8, 10), generator=torch.Generator().manual_seed(2))})
    mask = torch.ones(8, 10)
    batch = batch.with_fields(loss_mask=mask)
    cfg, _ = make_cfg("policy.num_workers=2", "policy.use_distributed_optimizer=true", "policy.micro_batch_size=4")
    after = {}
    for name in ["continued", "resumed"]:
        policy = model_workers.start(cfg, tiny_qwen2)
        if name == "continued":
            policy.train(batch, batch_totals(mask), NextTokenNLL())
            policy.save_checkpoint(str(tmp_path), "dist")
        else:
            policy.load_checkpoint(str(tmp_path), "dist")
        policy.train(batch, batch_totals(mask), NextTokenNLL())
        after[name] = policy.logprobs(batch)
        if name == "continued":
            assert policy.finish_checkpoint(wait=True)  # the digests of the files written
            # its state is gathered to data-parallel rank 0 at the save: no rank could size a reservation
            assert [reserved for reserved, _, _ in reserved_and_staged(policy)] == [None, None]
    assert torch.equal(after["continued"], after["resumed"])


@pytest.mark.parametrize("save_format", ["dist", "hf"])
def test_convert_exports_hf_weights(warm_pool, make_cfg, tmp_path, save_format, capsys):
    """`rlkit convert` (the CLI's main, in this process) from either format, into a new folder,
    saying what it wrote; into a folder holding a user's files it refuses in one line, before any
    worker starts, and leaves the files as they were."""
    cfg, resolved = make_cfg("algorithm.num_steps=1", "algorithm.prompts_per_step=8",
                             "policy.train_global_batch_size=64", f"checkpoint.save_format={save_format}",
                             f"run.output_dir={tmp_path}")
    train(cfg, resolved, pool=warm_pool)
    checkpoint = tmp_path / "grpo_tiny_cpu" / "checkpoints" / "step_000001"
    users = tmp_path / "users"
    users.mkdir()
    mine = {"config.json": '{"mine": true}', "adapter_config.json": "{}"}  # an old adapter's
    for name, text in mine.items():
        (users / name).write_text(text)
    capsys.readouterr()
    assert main(["convert", str(checkpoint), str(users)]) == 2
    refusal = capsys.readouterr().err
    assert re.fullmatch(rf"rlkit: config error: rlkit convert: the output {re.escape(str(users))} already holds files "
                        rf"\(adapter_config.json, config.json\); .*\n", refusal), refusal
    assert {p.name: p.read_text() for p in users.iterdir()} == mine
    out = tmp_path / "exported"
    assert main(["convert", str(checkpoint), str(out)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("HF ")]  # not the workers' logs
    files = [p for p in out.rglob("*") if p.is_file()]
    assert said == [f"HF checkpoint written to {out} ({len(files)} files, "
                    f"{sum(p.stat().st_size for p in files) / 1e6:.1f} MB)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "grpo_tiny_cpu", "users"]  # nothing partial
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_a_full_disk_ends_the_run_in_one_line_and_leaves_no_unfinished_checkpoint(warm_pool, make_cfg, tmp_path,
                                                                                     capsys):
    """Checkpoints on a 10 MB disk (a tmpfs mounted for the test, which needs root;
    tests/unit/test_checkpoint_full_disk.py fills one without), where one of this run's takes 6.6 MB:
    step 1's fits, step 2's fills the disk in the policy workers' background write. The run ends with
    one line naming the folder and its free space, and step 2's unfinished files are gone. So does
    `rlkit convert` of step 1 onto that disk, filled but for 0.5 MB (the export takes 2 MB)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        cfg, resolved = make_cfg("algorithm.num_steps=3", "checkpoint.every=1", "algorithm.val_every=100",
                                 "algorithm.val_before_training=false", "algorithm.prompts_per_step=8",
                                 "policy.train_global_batch_size=64", f"checkpoint.dir={disk}",
                                 f"run.output_dir={tmp_path}")
        with pytest.raises(CheckpointWriteError) as error:
            train(cfg, resolved, pool=warm_pool)
        folder = re.escape(str(disk))
        # torch's writer drops the OSError (RuntimeError: unexpected pos): the disk is found full by its free space
        assert re.fullmatch(rf"checkpoint step_000002 could not be written into {folder}: (No space left on device|the "
                            rf"disk is full) \(0.0 MB free there; the last checkpoint took [\d.]+ MB\); its unfinished "
                            rf"files \([\d.]+ MB\) are removed: .* resume from {folder}/step_000001", str(error.value))
        assert [path.name for path in disk.iterdir()] == ["step_000001"]
        assert verify(disk / "step_000001") is None
        (disk / "filler").write_bytes(bytes(max(shutil.disk_usage(disk).free - 500_000, 0)))
        capsys.readouterr()
        assert main(["convert", str(disk / "step_000001"), str(disk / "exported")]) == 1
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlkit:")]
        assert len(said) == 1 and re.fullmatch(rf"rlkit: the export could not be written beside {folder}/exported: "
                                               rf"(No space left on device|the disk is full) \(0.\d MB free there; "
                                               rf"its unfinished files, [\d.]+ MB, are removed\): .*", said[0]), said
        assert sorted(path.name for path in disk.iterdir()) == ["filler", "step_000001"]  # nothing partial
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_dead_worker_is_named_and_the_last_checkpoint_resumes(ray_cluster, make_cfg, tmp_path):
    cfg, resolved = make_cfg("algorithm.num_steps=40", "checkpoint.every=1", "algorithm.val_every=100",
                             "algorithm.prompts_per_step=8", "policy.train_global_batch_size=64",
                             "cluster.call_timeout_s=60", "cluster.collective_timeout_s=60",
                             f"run.output_dir={tmp_path}")
    run_dir = tmp_path / cfg.run.name

    def kill_a_policy_worker():
        while last_logged_step(run_dir) < 2:
            time.sleep(0.05)
        # the run's live policy actors (not the session's pooled workers, which have a name), by process id
        actors = ray._private.state.actors().values()
        victim = next(a["Pid"] for a in actors if a["ActorClassName"] == "MegatronModelWorker"
                      and a["State"] == "ALIVE" and not a["Name"])
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_a_policy_worker, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerError) as error:
        train(cfg, resolved)
    message = str(error.value)
    # "died during '<call>'" (also when the surviving worker's collective fails first), or, when the
    # kill lands inside a checkpoint write whose forked writer keeps the dead worker's connection
    # open, "did not finish '<call>' within 60s": both name the step, the role and the rank, within
    # the configured timeout
    assert re.match(r"step \d+: policy worker(\(s\))? .*(died during|did not finish)", message), message
    assert "last complete checkpoint is" in message
    assert time.monotonic() - start < 120
    # the last complete checkpoint is intact: the same run resumes from it and finishes
    cfg, resolved = make_cfg("algorithm.num_steps=5", "checkpoint.every=1", "algorithm.val_every=100",
                             "algorithm.prompts_per_step=8", "policy.train_global_batch_size=64",
                             f"run.output_dir={tmp_path}")
    history = train(cfg, resolved).history
    assert [m["step"] for m in history] == list(range(6))  # step 0 (validation) through 5, once each
    assert ray.is_initialized()
    # the workers' own files are in the manifest: one rank's RNG file lost is found before any
    # worker starts, and the checkpoint before it is taken
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir)
    *_, before, newest = checkpoints.complete()
    assert {"rng/policy_rank_0.pt", "controller.pt"} <= set(json.loads((newest / MANIFEST).read_text())["files"])
    assert any(name.startswith("policy/") for name in json.loads((newest / MANIFEST).read_text())["files"])
    os.remove(newest / "rng" / "policy_rank_0.pt")
    assert checkpoints.to_resume() == before
    # a finished run given other training settings refuses them, naming each; given its own (and
    # fewer steps) it says it is finished, without starting anything
    with pytest.raises(ConfigError, match=r"policy\.train_global_batch_size: 64 -> 256, algorithm\.prompts_per_step: "
                                          r"8 -> 64; set another run\.name"):
        train(*make_cfg("algorithm.num_steps=4", f"run.output_dir={tmp_path}"))
    cfg, resolved = make_cfg("algorithm.num_steps=4", "algorithm.prompts_per_step=8", "policy.train_global_batch_size=64",
                             f"run.output_dir={tmp_path}")
    start = time.monotonic()
    assert [m["step"] for m in train(cfg, resolved).history] == list(range(5))
    assert time.monotonic() - start < 5
