"""What goes into a Megatron model for a micro-batch, and what comes out per token, on one rank:
its context-parallel share of the rows' tokens, positions and packed-attention mask, and the
token-aligned head outputs (logprobs and entropy at the sampling temperature, or a critic's
values) gathered back over context parallelism."""

import torch

from rlkit.bridge.context_parallel import gather_sequence, padded_length, positions_on_rank, share_of_rank
from rlkit.data.batch import Batch
from rlkit.data.packing import packed_attention_mask
from rlkit.workers.policy.token_head import token_logprobs_and_entropy


class TokenIO:
    def __init__(self, mpu, head: str):
        """mpu: megatron's parallel_state, initialized; head: "lm" (a policy), or "value" (a critic) or
        "reward" (a reward model), which output a scalar per position."""
        self.mpu, self.head = mpu, head
        self.temperature = 1.0  # logprobs are of softmax(logits / temperature), as the sampler drew them

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's share of a [b, S, ...] tensor's positions (the whole of it at CP=1)."""
        return share_of_rank(x, self.mpu.get_context_parallel_world_size(), self.mpu.get_context_parallel_rank())

    def token_aligned(self, per_position: torch.Tensor, width: int) -> torch.Tensor:
        """[b, width] from this CP rank's share of per-position outputs (position t: about token
        t + 1): the whole rows gathered over CP (their padding dropped), shifted one right so that
        position t holds the output for token t; position 0 has none and holds 0. Every CP rank
        computes the same loss from the result, so each keeps its own share of its gradient."""
        whole = gather_sequence(per_position, self.mpu.get_context_parallel_group(), sum_grads=False, dim=1)
        return torch.nn.functional.pad(whole[:, :width - 1], (1, 0))

    def logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logprobs_and_entropy(logits, input_ids, entropy=False)[0]

    def logprobs_and_entropy(self, logits: torch.Tensor, input_ids: torch.Tensor, entropy: bool,
                                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token-aligned logprobs [b, S]: position t holds log p(input_ids[t] | input_ids[:t]);
        position 0 has no prediction and holds 0. With entropy, that distribution's entropy [b, S]
        aligned likewise (None without), with its gradient when entropy_grad (an entropy bonus in
        the loss). logits are vocab-parallel [b, S / CP, V/TP] of this CP rank's positions, read at
        the sampling temperature."""
        next_ids = self.share(torch.nn.functional.pad(input_ids[:, 1:], (0, 1)))  # the last predicts nothing read
        logprobs, token_entropy = token_logprobs_and_entropy(
            logits, next_ids, self.temperature, self.mpu.get_tensor_model_parallel_group(),
            entropy=entropy, entropy_grad=entropy_grad)
        width = input_ids.shape[1]
        return (self.token_aligned(logprobs, width),
                None if token_entropy is None else self.token_aligned(token_entropy, width))

    def model_inputs(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens, positions and attention mask of this CP rank's share of a micro-batch's rows, each
        row padded to a multiple of 2 x CP (nothing read depends on the padding: causal attention,
        and a packed row's padding is segment 0). The mask is None for right-padded rows (the
        default causal mask is exact), else the rows of this rank's queries."""
        tokens = mb["input_ids"]
        if "segment_ids" not in mb:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            return self.share(tokens), self.share(positions), None
        # packed rows: attention stays inside each sequence
        cp_size, cp_rank = self.mpu.get_context_parallel_world_size(), self.mpu.get_context_parallel_rank()
        length = padded_length(tokens.shape[1], cp_size)
        segment_ids = torch.nn.functional.pad(mb["segment_ids"], (0, length - tokens.shape[1]))
        attention_mask = packed_attention_mask(segment_ids, positions_on_rank(length, cp_size, cp_rank))
        return self.share(tokens), self.share(mb["position_ids"]), attention_mask

    def head_output(self, output: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Token-aligned [b, S]: logprobs for the policy; for the critic, position t holds the
        value of the state before token t (the prefix input_ids[:t]), aligned like the logprobs."""
        if self.head == "lm":
            return self.logprobs(output, input_ids)
        return self.token_aligned(output[..., 0].float(), input_ids.shape[1])
