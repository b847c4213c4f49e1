"""policy.peft through Megatron-Bridge's LoRA, on rlkit's policy worker (one gloo rank, run in this
process so its model and optimizer can be read): on the same adapter, the worker's logits and
adapter gradients equal HF `peft`'s (fp32, TP=1); the refit export is the base with the adapters
merged, equal to peft's merge_and_unload(); the KL reference is the base with the adapters off (no
second copy of the weights); a training step moves the adapters only, the base bit for bit
untouched, and the optimizer holds state for the adapters alone; a reference saved from the
adapted policy becomes its base without changing it; a distributed checkpoint holds the adapters
alone and restores them; the adapter written as an HF PEFT directory loads in peft with the
policy's logprobs."""

import json
import socket

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from test_policy_parity import TOLERANCE, _hf_logprobs
from transformers import AutoModelForCausalLM

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.bridge.adapters import MEGATRON_LINEAR
from rlkit.data.batch import Batch, batch_totals, supervised_batch
from rlkit.workers.policy.adapter_base import weights_digest
from rlkit.workers.policy.megatron import MegatronModelWorker

pytestmark = pytest.mark.integration
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8.0
PEFT = f"policy.peft={{type: lora, rank: {RANK}, alpha: {ALPHA}, dropout: 0.0, target_modules: [{','.join(TARGETS)}]}}"


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2):
    return tiny_qwen2


@pytest.fixture(scope="module")
def worker(make_cfg, model_dir):
    """The policy worker with LoRA on every linear layer, its adapters set to random values (as
    created, B = 0 and the adapters add nothing to compare)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    cfg, _ = make_cfg("policy.bridge=megatron_bridge", PEFT, "policy.num_workers=1", "policy.micro_batch_size=4",
                      "policy.optimizer.lr=1e-2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = MegatronModelWorker(cfg.policy, str(model_dir), rank=0, world_size=1, seed=0, threads=2,
                                 collective_timeout_s=120)
    policy.setup("127.0.0.1", port)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in _adapters(policy).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    yield policy
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


def _adapters(policy) -> dict[str, torch.nn.Parameter]:
    return {name: param for name, param in policy.model[0].named_parameters() if param.requires_grad}


def _peft_model(model_dir, policy):
    """The HF model under HF peft's LoRA, its adapters the worker's (mapped to HF PEFT names by the
    bridge: a fused layer's A shared by its HF modules, its B split between them)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS))
    adapters = {f"base_model.model.{name}": tensor.detach().clone() for name, tensor in
                policy.bridge.export_adapter_weights(policy.model)}
    loaded = set_peft_model_state_dict(model, adapters)
    assert not loaded.unexpected_keys
    lora_params = [name for name, _ in model.named_parameters() if ".lora_" in name]
    assert len(lora_params) == len(adapters) == 2 * len(TARGETS) * base.config.num_hidden_layers
    return model


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(1))


def test_logits_and_adapter_gradients_equal_hf_peft(worker, model_dir, tokens):
    """Loss: logits against fixed random weights. Megatron's fused layers hold one A for several
    HF modules: its gradient is the sum of theirs; its B's gradient is theirs side by side (read
    through the bridge's own adapter export, with the gradients in place of the weights)."""
    hf = _peft_model(model_dir, worker)
    vocab = hf.config.vocab_size
    weights = torch.randn(*tokens.shape, vocab, generator=torch.Generator().manual_seed(2))
    hf_logits = hf(tokens).logits
    (hf_logits * weights).sum().backward()

    chunk = worker.model[0]
    chunk.eval()
    chunk.zero_grad_buffer()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = chunk(tokens, positions, None)[..., :vocab]
    assert (logits - hf_logits).abs().max().item() < TOLERANCE
    (logits * weights).sum().backward()

    adapters = _adapters(worker)
    values = {name: param.detach().clone() for name, param in adapters.items()}
    with torch.no_grad():
        for param in adapters.values():
            param.copy_(param.main_grad)
        # cloned: the export may hand out the parameters themselves
        gradients = {name: tensor.clone() for name, tensor in worker.bridge.export_adapter_weights(worker.model)}
        for name, param in adapters.items():
            param.copy_(values[name])
    chunk.zero_grad_buffer()
    hf_grads = {name.removeprefix("base_model.model.").replace(".default", ""): param.grad
                for name, param in hf.named_parameters() if ".lora_" in name}
    assert set(gradients) == set(hf_grads)
    for name, gradient in gradients.items():
        expected = hf_grads[name]
        if ".lora_A." in name:  # the fused layer's shared A: the sum over the HF modules it serves
            module = name.split(".")[-3]
            layer = name[:name.rindex(module)]
            expected = sum(hf_grads[f"{layer}{sibling}.lora_A.weight"] for sibling, linear in MEGATRON_LINEAR.items()
                           if linear == MEGATRON_LINEAR[module] and sibling in TARGETS)
        assert gradient.shape == expected.shape, name
        assert (gradient - expected).abs().max().item() < TOLERANCE * max(1.0, expected.abs().max().item()), name


def test_the_export_is_the_base_with_the_adapters_merged_as_peft_merges_them(worker, model_dir):
    """What refit sends the generation workers (export_hf_weights; no row export under LoRA)."""
    assert worker.export_rows() is None
    exported = worker.export_hf_weights()
    merged = _peft_model(model_dir, worker).merge_and_unload().state_dict()
    assert set(exported) <= set(merged) and len(exported) >= len(merged) - 1  # a tied lm_head is not exported
    for name, tensor in exported.items():
        assert (tensor - merged[name]).abs().max().item() < 1e-6, name
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert any(not torch.equal(exported[name], base[name]) for name in exported)  # the adapters are in it


def test_the_reference_is_the_base_with_the_adapters_off(worker, model_dir, tokens):
    batch = Batch({"input_ids": tokens})
    worker.init_reference(str(model_dir))
    assert worker.reference is None  # no second model
    reference = worker.reference_logprobs(batch)
    assert (reference - _hf_logprobs(model_dir, tokens)).abs().max().item() < TOLERANCE
    policy = worker.forward(batch)  # the adapters are back on afterwards
    assert (policy - reference).abs().max().item() > 1e-3


def test_a_training_step_moves_the_adapters_only_and_adam_holds_state_for_them_alone(worker):
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 300, (8, 6), generator=generator).tolist()
    targets = torch.randint(0, 300, (8, 4), generator=generator).tolist()
    batch = supervised_batch(prompts, targets, pad_id=0)
    before = {name: param.detach().clone() for name, param in worker.model[0].named_parameters()}
    worker.train(batch, batch_totals(batch["loss_mask"]), NextTokenNLL())

    adapters = _adapters(worker)
    after = dict(worker.model[0].named_parameters())
    frozen = [name for name in after if name not in adapters]
    assert frozen and all(".adapter." in name for name in adapters)
    assert [name for name in frozen if not torch.equal(after[name], before[name])] == []
    assert [name for name in adapters if torch.equal(after[name], before[name])] == []

    stepped = [param for group in worker.optimizer.param_groups for param in group["params"]]
    assert {id(param) for param in stepped} == {id(param) for param in adapters.values()}
    state = [value for inner in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
             for per_param in inner.optimizer.state.values() for value in per_param.values()
             if torch.is_tensor(value) and value.dim() > 0]
    adapter_numel = sum(param.numel() for param in adapters.values())
    # Adam's two moments in fp32, nothing for the frozen weights
    assert sum(value.numel() * value.element_size() for value in state) == 2 * 4 * adapter_numel


def test_a_reference_saved_from_the_adapted_policy_becomes_its_base(worker, tmp_path):
    """A warm start trains the adapters, is saved merged, and is the run's reference: it becomes
    the base, the adapters restart from nothing added, and the policy computes as it did."""
    batch = Batch({"input_ids": torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(4))})
    policy = worker.forward(batch)
    worker.save_hf(str(tmp_path / "warm"))
    worker.init_reference(str(tmp_path / "warm"))
    assert (worker.forward(batch) - policy).abs().max().item() < TOLERANCE
    assert (worker.reference_logprobs(batch) - policy).abs().max().item() < TOLERANCE
    assert all(not param.any() for name, param in _adapters(worker).items() if ".linear_out." in name)


def test_an_adapter_checkpoint_holds_the_adapters_and_a_record_of_their_base(worker, tmp_path):
    """A distributed checkpoint of a LoRA policy is the adapters alone and the base's digest: it
    restores every adapter and leaves the frozen base to its HF checkpoint."""
    saved = {name: param.detach().clone() for name, param in worker.model[0].named_parameters()}
    worker.save_checkpoint(str(tmp_path), "dist")
    worker.finish_checkpoint(wait=True)
    record = json.loads((tmp_path / "policy" / "base.json").read_text())
    assert record == {"hf_dir": worker.base_dir, "weights_sha256": weights_digest(worker.base_dir)}
    written = sum(path.stat().st_size for path in (tmp_path / "policy").rglob("*") if path.is_file())
    adapter_bytes = sum(param.numel() * param.element_size() for param in _adapters(worker).values())
    base_bytes = sum(param.numel() * param.element_size() for name, param in saved.items() if ".adapter." not in name)
    # the adapters with Adam's two moments, and file metadata: well under the base
    assert 3 * adapter_bytes < written < 3 * adapter_bytes + base_bytes // 4
    with torch.no_grad():
        for param in worker.model[0].parameters():
            param.add_(1.0)
    worker.load_checkpoint(str(tmp_path), "dist")
    restored = dict(worker.model[0].named_parameters())
    assert all(torch.equal(restored[name], saved[name]) for name in _adapters(worker))
    # the base is not in the checkpoint: it kept the change
    assert all(torch.equal(param, saved[name] + 1.0) for name, param in restored.items() if name not in _adapters(worker))
    # policy.peft.init_from: the adapters alone, from the same folder
    with torch.no_grad():
        for param in _adapters(worker).values():
            param.zero_()
    worker.bridge.load_adapter_checkpoint(worker.model, str(tmp_path / "policy"))
    assert all(torch.equal(param, saved[name]) for name, param in _adapters(worker).items())
    with torch.no_grad():
        for name, param in restored.items():
            param.copy_(saved[name])


def test_the_adapter_saved_as_hf_peft_loads_in_peft_with_the_policys_logits(worker, tmp_path, tokens):
    """`rlkit convert`'s adapter directory: HF peft loads it over the base (its recorded path) and
    computes the policy's logprobs; merged, it is the policy's merged export."""
    from peft import PeftModel

    worker.save_peft_adapter(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == worker.base_dir and config["r"] == RANK
    base = AutoModelForCausalLM.from_pretrained(worker.base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(tokens).logits[:, :-1].float(), dim=-1)
    expected = torch.nn.functional.pad(logprobs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1), (1, 0))
    assert (worker.forward(Batch({"input_ids": tokens})) - expected).abs().max().item() < TOLERANCE
    merged = model.merge_and_unload().state_dict()
    for name, tensor in worker.export_hf_weights().items():
        assert (tensor - merged[name]).abs().max().item() < 1e-6, name


def test_the_lora_recipe_warm_starts_every_weight_then_trains_adapters(warm_pool, cache_dir, tmp_path):
    """grpo_tiny_lora_cpu from a random model: adapters alone on it learn too little to answer
    (after 150 SFT steps of adapters only, reward 0), so the warm start tunes every weight on
    workers of its own; the adapters then start from an answering model and train."""
    from rlkit.launch.config import load_config
    from rlkit.launch.run import train

    cfg, resolved = load_config("grpo_tiny_lora_cpu", [
        f"run.cache_dir={cache_dir}", f"run.output_dir={tmp_path}", "algorithm.num_steps=2", "algorithm.val_every=2",
        "checkpoint.every=0", "algorithm.prompts_per_step=16", "policy.train_global_batch_size=128",
        # a warm start of its own (the key covers sft_steps): this run trains it
        "algorithm.warm_start.sft_steps=61", "logger.plots=false"])
    history = train(cfg, resolved, pool=warm_pool).history
    assert history[0]["val/reward"] > 0.02  # the full-tuning warm start answers
    assert all(history[step]["train/grad_norm"] > 0 for step in (1, 2))  # the adapters train
    # the generation workers hold the merged adapters: the same logprobs as the policy
    assert all(history[step]["refit/logprob_abs_error_mean"] < 1e-5 for step in (1, 2))
