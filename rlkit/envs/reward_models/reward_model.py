"""A reward model as an environment: the reward is a sequence-classification model's score of
the conversation, the prompt's messages and the response rendered by the reward model's own
chat template (it need not share the policy's tokenizer: it reads text)."""

import functools

from rlkit.envs.base import EnvStep
from rlkit.envs.reward_models.model_dirs import REWARD_MODEL, dtype_problem, model_dir_problem, tokenizer_problem
from rlkit.envs.reward_models.normalize import NORMALIZATIONS, Normalizer
from rlkit.envs.reward_models.scorer import SequenceScorer
from rlkit.envs.reward_models.server import ServedModelEnv, ServerSettings


class RewardModelEnv(ServedModelEnv):
    """Single turn. model_path: a local directory saved by AutoModelForSequenceClassification
    (num_labels=1) with its tokenizer. chat_template=false scores the prompt and response as plain
    text (the model's tokenizer adds its special tokens). max_length: tokens of a conversation
    scored, its end kept (None: the model's positions). normalize: none | running (by the mean and
    standard deviation of every score so far, over all workers) | affine (scale * score + shift).
    report_length: the response's tokens beside the score. The server's keys: ServerSettings.

    Each step reports reward_model/raw_sum (the score before normalization), reward_model/scored,
    reward_model/truncated and, with report_length, reward_model/response_tokens_sum."""

    service = "reward_model"

    def __init__(self, model_path: str, chat_template: bool = True, max_length: int | None = None,
                 normalize: str = "none", scale: float = 1.0, shift: float = 0.0, report_length: bool = True,
                 dtype: str = "auto", num_gpus: float = 0.0, batch_size: int = 32, max_wait_s: float = 0.02,
                 timeout_s: float = 8.0, load_timeout_s: float = 300.0):
        self.model_path, self.chat_template, self.max_length = model_path, chat_template, max_length
        self.normalize, self.scale, self.shift, self.report_length = normalize, scale, shift, report_length
        self.dtype = dtype
        self.settings = ServerSettings(num_gpus, batch_size, max_wait_s, timeout_s, load_timeout_s)

    @classmethod
    def check_arguments(cls, *, model_path, chat_template, max_length, normalize, dtype, num_gpus, batch_size,
                        max_wait_s, timeout_s, load_timeout_s, **_) -> str | None:
        if normalize not in NORMALIZATIONS:
            return f"env.normalize: must be one of {list(NORMALIZATIONS)} (got: {normalize!r}); pick one of those"
        if max_length is not None and max_length < 1:
            return f"env.max_length: must be >= 1 (got: {max_length}); give tokens, or null for the model's positions"
        return (ServerSettings(num_gpus, batch_size, max_wait_s, timeout_s, load_timeout_s).problem()
                or dtype_problem(dtype) or model_dir_problem("env.model_path", model_path, REWARD_MODEL)
                or tokenizer_problem("env.model_path", model_path, chat_template))

    def loader(self):
        device = "cuda" if self.settings.num_gpus else "cpu"
        return functools.partial(SequenceScorer, self.model_path, device, self.dtype, self.max_length,
                                 not self.chat_template, Normalizer(self.normalize, self.scale, self.shift))

    def render(self, messages: list[dict]) -> str:
        """The conversation as the reward model reads it."""
        if self.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "".join(m["content"] for m in messages)

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        score, _ = self.model.request(self.render(messages))
        counts = {"reward_model/raw_sum": score.raw, "reward_model/scored": 1,
                  "reward_model/truncated": int(score.truncated)}
        if self.report_length:
            response = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
            counts["reward_model/response_tokens_sum"] = len(response)
        return EnvStep(reward=score.reward, done=True, counts=counts)
