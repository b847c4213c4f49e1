"""A reward model (the worker's head "reward") as an HF sequence classifier: its architecture's
<Architecture>ForSequenceClassification with num_labels=1, whose `score` layer (no bias) reads the
hidden state of a row's last token that is not the pad token, where rlkit reads a row's reward
(rlkit/algorithms/reward_model.py); so transformers' AutoModelForSequenceClassification scores as
the trained model does. The trunk keeps the bridge's own HF names: it is exported through a
language model built beside it and given the trunk's weights (ModelBridge.load_trunk_weights goes
the other way); the head's weight becomes `score.weight`."""

import copy

import torch
import torch.distributed as dist

from rlkit.bridge.common import copy_trunk, unwrap

LM_HEAD = "lm_head.weight"  # what the language model adds to the trunk: no part of a classifier
SCORE = "score.weight"


def sequence_classifier(model_type: str | None) -> str | None:
    """transformers' sequence classifier of an HF model type (qwen2: Qwen2ForSequenceClassification);
    None where it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)


def save_sequence_classifier(bridge, chunks: list, out_dir: str) -> None:
    """The reward model in `chunks` as an HF sequence classifier in out_dir (safetensors weights,
    config and tokenizer), written by rank 0. Collective. Rank 0 holds every weight on the host
    meanwhile."""
    trunk = trunk_weights(bridge, chunks)
    head = head_weight(chunks)
    if dist.get_rank() == 0:
        write_sequence_classifier(bridge.hf_config, bridge.hf_dir, {**trunk, SCORE: head}, out_dir)
    dist.barrier()


def trunk_weights(bridge, chunks: list) -> dict[str, torch.Tensor]:
    """Every HF-named weight of the trunk, on the host of rank 0 ({} elsewhere). Collective."""
    lm = bridge.build(bf16=_parameter(chunks).dtype == torch.bfloat16, wrap_with_ddp=False)
    copy_trunk(chunks, lm)
    weights = {}
    for name, tensor in bridge.export_hf_weights(lm):  # every rank iterates it to the end
        if dist.get_rank() == 0 and name != LM_HEAD:
            weights[name] = tensor.detach().to("cpu", copy=True)
    return weights


def head_weight(chunks: list) -> torch.Tensor:
    """The head's weight [1, hidden] on the host: the last pipeline stage holds it, and sends it to
    the first. Collective."""
    from megatron.core import parallel_state as mpu

    last, parameter = unwrap(chunks[-1]), _parameter(chunks)
    if last.post_process:
        weight = last.output_layer.weight.detach().clone()
    else:
        weight = torch.empty(1, last.config.hidden_size, dtype=parameter.dtype, device=parameter.device)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(weight, mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
    return weight.cpu()


def _parameter(chunks: list) -> torch.Tensor:
    """A parameter of the model: its dtype and device are every parameter's."""
    return next(unwrap(chunks[0]).parameters())


def write_sequence_classifier(hf_config, hf_dir: str, weights: dict[str, torch.Tensor], out_dir: str) -> None:
    """weights (the trunk's HF names and SCORE) as an HF sequence classifier of hf_config's
    architecture in out_dir, with the tokenizer of the checkpoint hf_dir."""
    from huggingface_hub import save_torch_state_dict

    from rlkit.models.tokenizer import load_tokenizer

    config = copy.deepcopy(hf_config)
    classifier = sequence_classifier(config.model_type)
    if classifier is None:  # rlkit convert refuses such a checkpoint before any worker starts
        raise ValueError(f"transformers has no sequence classifier for {config.model_type} models")
    tokenizer = load_tokenizer(hf_dir)  # with rlkit's pad token (EOS where the model has none)
    config.architectures = [classifier]
    config.num_labels = 1
    # HF reads each row's score at its last token that is not this one, as rlkit reads the reward
    config.pad_token_id = tokenizer.pad_token_id
    config.tie_word_embeddings = False  # no LM head to tie to the embedding
    save_torch_state_dict(weights, out_dir)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
