"""policy.backend=fsdp2 (rlkit/workers/policy/fsdp2.py) against Megatron on the same tiny Qwen2 and
Llama in fp32: the FSDP2 policy's two ranks, each holding half of every weight and its own half of
the rows, give the token logprobs of Megatron's one rank, and one SFT step gives the same loss,
gradient norm and logprobs after it. Its export, gathered from the shards, is the checkpoint bit
for bit under the checkpoint's names; its checkpoints (dist: torch.distributed.checkpoint; hf: HF
weights beside the optimizer's distributed state) load into new workers, whose next step is the
uninterrupted run's bit for bit, and a run killed with SIGKILL resumes to the uninterrupted run's
end. Packed rows (SFT's) give Megatron's logprobs too; refit streams bf16 compute's weights in bf16.

Tolerance 1e-5 as in test_policy_parity.py (Megatron against transformers)."""

import pytest
import ray
import torch
from safetensors.torch import load_file
from test_checkpoint import kill_when, run_in_process, train_command
from test_warm_pool import _process_group_and_gloo_threads
from transformers import AutoModelForSequenceClassification

from rlkit.algorithms.objectives import BradleyTerry, NextTokenNLL, ValueRegression
from rlkit.data.batch import Batch, batch_totals
from rlkit.data.packing import pack_sequences
from rlkit.launch.config import load_config
from rlkit.models.resolve import resolve_model_dir
from rlkit.models.tokenizer import load_tokenizer
from rlkit.refit.plan import RefitPlan
from rlkit.workers.policy.base import TrainingBackend as Model

pytestmark = pytest.mark.integration
TOLERANCE = 1e-5
SAVE_FORMATS = ("dist", "hf")  # checkpoint.save_format
BACKENDS = {"megatron": ["policy.num_workers=1"], "fsdp2": ["policy=fsdp2_tiny", "policy.num_workers=2"]}


# two rows of sequences back to back (each attends within itself only), as SFT packs them
PACKED = pack_sequences([([5, 9, 14, 3, 7], [0, 1, 1, 1, 1]), ([11, 2, 8], [0, 1, 1]), ([4, 4, 6, 12], [0, 1, 1, 1]),
                         ([20, 21, 22, 23, 24, 25], [0, 1, 1, 1, 1, 1])], max_length=10, pad_id=0, pack=True)


def _rows(count: int, seed: int) -> Batch:
    """Rows of 11 tokens whose loss masks end at different lengths (from 4 to 11)."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.randint(4, 12, (count, 1), generator=g)
    positions = torch.arange(11)
    return Batch({"input_ids": torch.randint(0, 300, (count, 11), generator=g),
                  "loss_mask": ((positions >= 1) & (positions < ends)).float()})


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def runs(request, model_workers, make_cfg, tmp_path_factory) -> dict[str, dict]:
    """Per backend: the export before training, logprobs of 8 rows and of 2 packed ones, one step's
    metrics on the 8 (micro-batches of 4) and the logprobs after it. FSDP2's also: a checkpoint in
    each format after that step, a second step, and that second step again on new workers that
    loaded each checkpoint."""
    rows, later, results = _rows(8, 0), _rows(8, 1), {}
    for name, overrides in BACKENDS.items():
        cfg, _ = make_cfg(*overrides, f"policy.model_path=tiny://{request.param}", "policy.micro_batch_size=4",
                          "policy.train_global_batch_size=8")
        model_dir = resolve_model_dir(cfg)
        policy = model_workers.start(cfg, model_dir)
        results[name] = {"model_dir": model_dir, "exported": policy.export_hf_weights(),
                         "logprobs": policy.logprobs(rows), "packed logprobs": policy.logprobs(PACKED),
                         "step": policy.train(rows, batch_totals(rows["loss_mask"]), NextTokenNLL()),
                         "logprobs after": policy.logprobs(rows)}
    checkpoints = {save_format: str(tmp_path_factory.mktemp(f"fsdp2_{save_format}")) for save_format in SAVE_FORMATS}
    for save_format, checkpoint in checkpoints.items():
        policy.save_checkpoint(checkpoint, save_format)
        policy.finish_checkpoint(wait=True)
    results["fsdp2"]["second step"] = _step_and_weights(policy, later)
    for save_format, checkpoint in checkpoints.items():
        resumed = model_workers.start(cfg, model_dir)
        resumed.load_checkpoint(checkpoint, save_format)
        results["fsdp2"][f"resumed second step, {save_format}"] = _step_and_weights(resumed, later)
    return results


def _step_and_weights(policy, rows: Batch) -> tuple[dict, dict]:
    return policy.train(rows, batch_totals(rows["loss_mask"]), NextTokenNLL()), policy.export_hf_weights()


def test_the_export_is_the_checkpoint_bit_for_bit(runs):
    checkpoint = load_file(runs["fsdp2"]["model_dir"] / "model.safetensors")
    assert runs["fsdp2"]["exported"].keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(runs["fsdp2"]["exported"][name], tensor), name


def test_logprobs_match_megatron(runs):
    assert (runs["fsdp2"]["logprobs"] - runs["megatron"]["logprobs"]).abs().max().item() < TOLERANCE
    # every token of the packed sequences (a micro-batch is cut to its longest row: padding reads 0)
    tokens = PACKED["segment_ids"] > 0
    packed = runs["fsdp2"]["packed logprobs"][tokens] - runs["megatron"]["packed logprobs"][tokens]
    assert packed.abs().max().item() < TOLERANCE


def test_a_train_step_matches_megatron(runs):
    fsdp2, megatron = runs["fsdp2"], runs["megatron"]
    assert fsdp2["step"]["loss"] == pytest.approx(megatron["step"]["loss"], abs=TOLERANCE)
    assert fsdp2["step"]["grad_norm"] == pytest.approx(megatron["step"]["grad_norm"], rel=TOLERANCE)
    assert (fsdp2["logprobs after"] - megatron["logprobs after"]).abs().max().item() < TOLERANCE
    assert (fsdp2["logprobs after"] - fsdp2["logprobs"]).abs().max().item() > 100 * TOLERANCE  # the step moved them


@pytest.mark.parametrize("save_format", SAVE_FORMATS)
def test_a_checkpoint_resumes_the_next_step_exactly(runs, save_format):
    step, weights = runs["fsdp2"]["second step"]
    resumed_step, resumed_weights = runs["fsdp2"][f"resumed second step, {save_format}"]
    assert resumed_step == step  # weights and Adam's moments and step count all came back
    for name, weight in weights.items():
        assert torch.equal(resumed_weights[name], weight), name


def test_bf16_compute_with_an_fp32_lm_head_and_activation_checkpointing_follows_fp32(model_workers, make_cfg):
    """policy.precision=bf16 (FSDP2's MixedPrecisionPolicy: bf16 compute over fp32 weights and Adam),
    policy.fp32_lm_head (Phi-3's untied head in fp32) and policy.fsdp2.activation_checkpointing
    (layers recomputed in backward) give fp32's logprobs and step to bf16's precision. Refit streams
    the weights as the model computes with them, as Megatron's bf16 parameters go (bf16, the head
    fp32): the fp32 weights rounded, half their bytes; the HF export keeps them fp32."""
    rows, results = _rows(8, 0), {}
    for precision, checkpointing in [("fp32", "false"), ("bf16", "true")]:
        cfg, _ = make_cfg("policy=fsdp2_tiny", "policy.num_workers=2", "policy.model_path=tiny://phi3",
                          f"policy.precision={precision}", f"policy.fsdp2.activation_checkpointing={checkpointing}",
                          "policy.micro_batch_size=4", "policy.train_global_batch_size=8")
        policy = model_workers.start(cfg, resolve_model_dir(cfg))
        results[precision] = (policy.logprobs(rows), policy.train(rows, batch_totals(rows["loss_mask"]),
                                                                   NextTokenNLL()))
    (fp32_logprobs, fp32_step), (bf16_logprobs, bf16_step) = results["fp32"], results["bf16"]
    assert 0 < (bf16_logprobs - fp32_logprobs).abs().max().item() < 0.05  # bf16 rounding, and no more
    assert bf16_step["loss"] == pytest.approx(fp32_step["loss"], rel=1e-2)
    assert bf16_step["grad_norm"] == pytest.approx(fp32_step["grad_norm"], rel=5e-2)
    streamed, exported = _streamed_refit(policy), policy.export_hf_weights()
    assert streamed.keys() == exported.keys() and {t.dtype for t in exported.values()} == {torch.float32}
    for name, tensor in streamed.items():
        assert tensor.dtype == (torch.float32 if name == "lm_head.weight" else torch.bfloat16), name
        assert torch.equal(tensor, exported[name].to(tensor.dtype)), name


def _streamed_refit(policy) -> dict[str, torch.Tensor]:
    """What refit streams through Ray's object store (rank 0 yields the buckets, the other ranks
    join the gathers), each tensor in its manifest's dtype (no transfer dtype)."""
    plan = RefitPlan.build(policy.workers.every_rank(Model.refit_manifest)[0], 2**20)
    streams = [actor.stream_refit_buckets.options(num_returns="streaming").remote(plan, True)
               for actor in policy.workers.actors]
    buckets = [ray.get(ref) for ref in streams[0]]
    for stream in streams[1:]:
        ray.get(list(stream))
    return {name: tensor.clone() for bucket in buckets for name, tensor in plan.unpack(bucket, verify=True)}


def test_a_critic_matches_megatrons(model_workers, cache_dir, tmp_path_factory):
    """PPO's critic (a zero-initialised value head with a bias in the LM head's place, on the policy
    checkpoint's trunk): values before and after one clipped value-regression step, and the step's
    loss and gradient norm, FSDP2's two ranks against Megatron's one."""
    rows, returns = _rows(8, 0), torch.randn(8, 11, generator=torch.Generator().manual_seed(3))
    batch = rows.with_fields(response_mask=rows["loss_mask"], old_values=torch.zeros(8, 11), returns=returns)
    results = {}
    for name, overrides in BACKENDS.items():
        cfg, _ = load_config("ppo_tiny_cpu", [*overrides, "policy.micro_batch_size=4", "policy.train_global_batch_size=8",
                                              "algorithm.warm_start.sft_steps=0", f"run.cache_dir={cache_dir}",
                                              f"run.output_dir={tmp_path_factory.mktemp('critic')}"])
        critic = model_workers.start(cfg, resolve_model_dir(cfg), head="value")
        results[name] = (critic.logprobs(batch), critic.train(batch, batch_totals(batch["response_mask"]),
                                                              ValueRegression(clip=0.2, aggregation="token-mean")),
                         critic.logprobs(batch))
    (fsdp2_before, fsdp2_step, fsdp2_after), (megatron_before, megatron_step, megatron_after) = results.values()
    assert fsdp2_before.abs().max().item() == megatron_before.abs().max().item() == 0.0  # the heads start at zero
    assert fsdp2_step["loss"] == pytest.approx(megatron_step["loss"], abs=TOLERANCE)
    assert fsdp2_step["grad_norm"] == pytest.approx(megatron_step["grad_norm"], rel=TOLERANCE)
    assert fsdp2_after.abs().max().item() > 100 * TOLERANCE  # the step moved them
    assert (fsdp2_after - megatron_after).abs().max().item() < TOLERANCE


def test_a_reward_model_matches_megatrons_and_exports_as_a_sequence_classifier(model_workers, cache_dir,
                                                                              tmp_path_factory):
    """A reward model (the critic's head without its bias): rewards before and after one
    Bradley-Terry step on 4 pairs, and the step's loss and gradient norm, FSDP2's two ranks against
    Megatron's one; FSDP2's HF export, an HF sequence classifier, scores each row as the trained
    model reads its reward (after its last token, the first pad position)."""
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(3, 10, (8,), generator=g)
    positions = torch.arange(11)
    pad = load_tokenizer(resolve_model_dir(make_reward_cfg(cache_dir, tmp_path_factory, "megatron"))).pad_token_id
    input_ids = torch.where(positions < lengths[:, None], torch.randint(10, 300, (8, 11), generator=g), pad)
    rows = Batch({"input_ids": input_ids, "loss_mask": (positions == lengths[:, None]).float(), "margins": torch.zeros(8)})
    totals = batch_totals(rows["loss_mask"][0::2])  # rows alternate chosen, rejected: 4 pairs
    results = {}
    for name in BACKENDS:
        cfg = make_reward_cfg(cache_dir, tmp_path_factory, name)
        reward_model = model_workers.start(cfg, resolve_model_dir(cfg), head="reward")
        results[name] = (reward_model.train(rows, totals, BradleyTerry()), reward_model.logprobs(rows))
    (fsdp2_step, fsdp2_after), (megatron_step, megatron_after) = results["fsdp2"], results["megatron"]
    assert fsdp2_step["loss"] == pytest.approx(megatron_step["loss"], abs=TOLERANCE)  # log 2: the head starts at 0
    assert fsdp2_step["grad_norm"] == pytest.approx(megatron_step["grad_norm"], rel=TOLERANCE)
    assert (fsdp2_after - megatron_after).abs().max().item() < TOLERANCE
    exported = tmp_path_factory.mktemp("fsdp2_reward_model")
    reward_model.save_hf(str(exported))
    classifier = AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        scores = classifier(input_ids).logits[:, 0]
    rewards = (fsdp2_after * rows["loss_mask"]).sum(dim=1)
    assert rewards.abs().max().item() > 100 * TOLERANCE and (scores - rewards).abs().max().item() < TOLERANCE


def make_reward_cfg(cache_dir, tmp_path_factory, backend: str):
    cfg, _ = load_config("reward_model_tiny_cpu", [*BACKENDS[backend], "policy.micro_batch_size=4",
                                                   "policy.train_global_batch_size=8", "algorithm.warm_start.sft_steps=0",
                                                   f"run.cache_dir={cache_dir}",
                                                   f"run.output_dir={tmp_path_factory.mktemp('reward_model')}"])
    return cfg


def test_an_idle_fsdp2_worker_holds_no_process_group(model_workers, make_cfg):
    """Given back to the pool after a training step, an FSDP2 worker leaves its process group and
    frees it at once: idle, it runs none of the run's gloo threads (test_warm_pool.py: Megatron's)."""
    cfg, _ = make_cfg(*BACKENDS["fsdp2"], "policy.micro_batch_size=4", "policy.train_global_batch_size=8")
    policy = model_workers.start(cfg, resolve_model_dir(cfg))
    rows = _rows(8, 0)
    policy.train(rows, batch_totals(rows["loss_mask"]), NextTokenNLL())
    worker = policy.workers.actors[0]
    in_group, threads_in_run = _process_group_and_gloo_threads(worker)
    model_workers.release()
    still_in_group, threads_idle = _process_group_and_gloo_threads(worker)
    assert in_group and threads_in_run > 0
    assert not still_in_group and threads_idle == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_an_moe_export_is_the_checkpoint_bit_for_bit(model_workers, make_cfg, arch):
    """transformers 5 fuses each MoE layer's experts into one tensor per projection as it loads:
    the export splits them back under the checkpoint's names, and carries the router's expert
    bias (a buffer), as the generation workers load them."""
    cfg, _ = make_cfg(*BACKENDS["fsdp2"], f"policy.model_path=tiny://{arch}")
    model_dir = resolve_model_dir(cfg)
    exported = model_workers.start(cfg, model_dir).export_hf_weights()
    checkpoint = load_file(model_dir / "model.safetensors")
    assert exported.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name], tensor), name


# three SFT steps on the FSDP2 policy, a checkpoint (HF weights beside Adam's state) after each,
# the learning rate warming up then decaying (the schedule resumes too)
KILLED_RUN = ("policy=fsdp2_tiny", "algorithm.num_steps=3", "algorithm.val_every=3",
              "algorithm.val_before_training=false", "checkpoint.every=1", "checkpoint.save_format=hf",
              "policy.train_global_batch_size=16", "policy.micro_batch_size=4", "policy.optimizer.lr_schedule=cosine",
              "policy.optimizer.warmup_steps=1", "policy.optimizer.min_lr_ratio=0.1", "logger.plots=false")


def test_an_sft_run_killed_with_sigkill_after_a_checkpoint_resumes_exactly(warm_pool, tmp_path_factory, cache_dir):
    """sft_tiny_cpu on the FSDP2 policy, killed with SIGKILL once step 2's checkpoint is complete
    and started again, ends with exactly the uninterrupted run's metrics and step 3's weights bit for
    bit: weights, Adam's moments and step count, the learning rate's schedule and the data order
    all came back (fp32 on CPU)."""
    reference_dir, killed_dir = tmp_path_factory.mktemp("sft_uninterrupted"), tmp_path_factory.mktemp("sft_killed")
    reference = run_in_process(warm_pool, "sft_tiny_cpu", reference_dir, cache_dir, run=KILLED_RUN)
    lrs = [reference[step]["train/lr"] for step in (1, 2, 3)]
    assert lrs[0] == lrs[1] > lrs[2] and all(reference[step]["train/grad_norm"] > 0 for step in (1, 2, 3))
    checkpoints = killed_dir / "sft_tiny_cpu" / "checkpoints"
    kill_when(train_command(killed_dir, cache_dir, recipe="sft_tiny_cpu", run=KILLED_RUN),
              lambda: (checkpoints / "step_000002").is_dir(), "after step 2's checkpoint", killed_dir / "run.log",
              worker="FSDP2ModelWorker")
    assert not (checkpoints / "step_000003").exists()  # step 3 is the resumed run's
    assert run_in_process(warm_pool, "sft_tiny_cpu", killed_dir, cache_dir, run=KILLED_RUN) == reference
    weights = [load_file(run / "sft_tiny_cpu" / "checkpoints" / "step_000003" / "policy" / "hf" / "model.safetensors")
               for run in (reference_dir, killed_dir)]
    assert weights[0].keys() == weights[1].keys()
    for name, weight in weights[0].items():
        assert torch.equal(weights[1][name], weight), name
