"""The training-backend interface (rlkit/workers/policy/base.py): a backend defined in this file
alone, in this process, without Ray or torch.distributed, is driven by rlkit's own controller
(the SFT trainer through ModelWorkers and run_steps: steps, validation, checkpoints) and learns;
the Megatron worker implements every method, and the controller calls nothing else."""

import ast
import re
from pathlib import Path

import torch

from rlkit.algorithms.loop import run_steps
from rlkit.algorithms.lr_schedule import schedule_of
from rlkit.algorithms.sft import SFT
from rlkit.checkpoint import CheckpointManager, WrittenFiles
from rlkit.cluster.groups import ModelWorkers
from rlkit.data.stream import ShuffledStream
from rlkit.launch.config import load_config
from rlkit.observability.metrics import MetricsLogger
from rlkit.observability.startup import StartupClock
from rlkit.workers.policy.base import TrainingBackend

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 16


class BigramBackend(TrainingBackend):
    """One rank of a bigram model: each token's logits from the token before it alone."""

    def __init__(self):
        self.table = self.optimizer = self.held = None
        self.temperature, self.lr = 1.0, 0.1

    def setup(self, master_addr, master_port):
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(VOCAB, VOCAB)
        self.optimizer = torch.optim.Adam(self.table.parameters(), lr=self.lr)

    def layout(self):
        return {"rank": 0, "tp": 0, "pp": 0, "cp": 0, "dp": 0, "is_output": True}

    def startup_phases(self):
        return {}

    def device_name(self):
        return None

    def _logprobs(self, input_ids):
        """Token-aligned: position t holds log p(input_ids[t] | input_ids[t - 1]); 0 at t = 0."""
        logprobs = torch.log_softmax(self.table(input_ids[:, :-1]) / self.temperature, dim=-1)
        return torch.nn.functional.pad(logprobs.gather(-1, input_ids[:, 1:, None])[..., 0], (1, 0))

    def forward(self, batch):
        with torch.no_grad():
            return self._logprobs(batch["input_ids"])

    def train(self, batch, totals, objective):
        self.optimizer.zero_grad()
        loss, sums = objective(self._logprobs(batch["input_ids"]), batch, totals)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.table.parameters(), float("inf"))
        self.optimizer.step()
        return {"loss": loss.item(), **{k: v.item() for k, v in sums.items()}, "entropy": 0.0,
                "grad_norm": grad_norm.item()}

    def set_temperature(self, temperature):
        self.temperature = temperature

    def set_learning_rate(self, lr):
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reset_optimizer(self):
        self.optimizer = torch.optim.Adam(self.table.parameters(), lr=self.lr)

    def hold(self, shard):
        self.held = shard

    def extend_held(self, fields):
        self.held = self.held.with_fields(**fields.tensors)

    def evaluate_held(self, totals, objective):
        with torch.no_grad():
            loss, sums = objective(self._logprobs(self.held["input_ids"]), self.held, totals)
        return {"loss": loss.item(), **{k: v.item() for k, v in sums.items()}}

    def save_checkpoint(self, ckpt_dir, save_format):
        folder = Path(ckpt_dir, "policy")
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"table": self.table.state_dict(), "optimizer": self.optimizer.state_dict()}, folder / "bigram.pt")
        return {"held": 0.0}

    def finish_checkpoint(self, wait):
        return WrittenFiles({})

    def load_checkpoint(self, ckpt_dir, save_format):
        state = torch.load(Path(ckpt_dir, "policy", "bigram.pt"))
        self.table.load_state_dict(state["table"])
        self.optimizer.load_state_dict(state["optimizer"])

    def sleep(self):
        return {}

    def wake(self):
        return {}

    def peak_memory_gb(self):
        return 0.0

    def release(self):
        self.__dict__.clear()

    def reset(self, args):
        self.release()
        self.__init__(**args)

    # what an SFT run never asks of its policy: rollouts, a reference, exports and refit
    def _not_in_sft(self, *args, **kwargs):
        raise NotImplementedError("an SFT run holds no rollout, reference, export or refit")

    init_reference = export_held = forward_held = estimate_held = train_held = _not_in_sft
    export_hf_weights = save_hf = save_peft_adapter = _not_in_sft
    refit_manifest = refit_gpu = open_refit_channel = join_refit_communicator = _not_in_sft
    stream_refit_buckets = send_refit = refit_stats = export_refit_adapters = _not_in_sft


class InProcessGroup:
    """WorkerGroup's dispatch over objects of this process: a call is a method call."""

    role = "policy"

    def __init__(self, workers: list):
        self.workers = workers

    def every_rank(self, method, *args, **kwargs):
        return [getattr(w, method.__name__)(*args, **kwargs) for w in self.workers]

    def only(self, ranks, method, *args, **kwargs):
        return [getattr(self.workers[r], method.__name__)(*args, **kwargs) for r in ranks]

    def share(self, values):
        return list(values)

    def per_shard(self, method, shards, shard_of_rank, output_ranks, *args, **kwargs):
        results = [getattr(w, method.__name__)(shards[shard_of_rank[r]], *args, **kwargs)
                   for r, w in enumerate(self.workers)]
        return [results[r] for r in output_ranks]


def examples(count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask): runs of consecutive tokens (mod VOCAB), every token but the first in the loss."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for start, length in zip(torch.randint(0, VOCAB, (count,), generator=generator).tolist(),
                             torch.randint(4, 9, (count,), generator=generator).tolist()):
        rows.append(([(start + i) % VOCAB for i in range(length)], [0] + [1] * (length - 1)))
    return rows


def test_the_sft_controller_drives_a_backend_defined_here(tmp_path):
    cfg, resolved = load_config("sft_tiny_cpu", [f"run.output_dir={tmp_path}", "run.name=bigram",
                                                 f"run.cache_dir={tmp_path}/cache", "algorithm.num_steps=12",
                                                 "algorithm.val_every=6", "checkpoint.every=6", "policy.num_workers=1",
                                                 "policy.train_global_batch_size=8", "policy.micro_batch_size=4",
                                                 "policy.optimizer.lr=0.1", "policy.optimizer.warmup_steps=0"])
    backend = BigramBackend()
    group = InProcessGroup([backend])
    group.every_rank(TrainingBackend.setup, "127.0.0.1", 0)
    policy = ModelWorkers(group)
    trainer = SFT(cfg, policy, 0, examples(16, seed=1), cfg.data.pack, cfg.policy.train_global_batch_size,
                  schedule_of(cfg.policy.optimizer, cfg.algorithm.num_steps))
    run_dir = tmp_path / "bigram"
    result = run_steps(cfg, resolved, trainer, ShuffledStream(examples(64, seed=0), trainer.rows_per_step, 0),
                       CheckpointManager(cfg.checkpoint, run_dir), MetricsLogger(cfg.logger, run_dir, "bigram", resolved),
                       None, lambda: None, StartupClock())
    val = [row["val/loss"] for row in result.history if "val/loss" in row]
    assert len(val) == 3 and val[-1] < 0.5 * val[0]  # before training, at step 6 and at step 12
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000006", "step_000012"]
    trained = backend.table.weight.detach().clone()
    backend.setup("127.0.0.1", 0)  # a fresh model, then the last checkpoint into it
    trainer.load(str(run_dir / "checkpoints" / "step_000012"), 12)
    assert torch.equal(backend.table.weight, trained)


def test_the_megatron_worker_implements_the_interface_and_the_controller_calls_only_it():
    from rlkit.workers.policy.megatron import MegatronModelWorker

    assert issubclass(MegatronModelWorker, TrainingBackend) and not MegatronModelWorker.__abstractmethods__
    called = set()
    for path in (ROOT / "rlkit" / "cluster").glob("*.py"):
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module == "rlkit.workers.policy.base" for a in node.names}
        called |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and isinstance(node.value, ast.Name) and node.value.id in aliases}
    assert len(called) >= 30 and called <= TrainingBackend.__abstractmethods__, called - TrainingBackend.__abstractmethods__
    # nothing in cluster/ names the Megatron worker's methods but the interface's
    for path in (ROOT / "rlkit" / "cluster").glob("*.py"):
        assert not re.search(r"MegatronModelWorker\.\w+", path.read_text()), path
