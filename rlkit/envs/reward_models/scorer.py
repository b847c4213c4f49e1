"""A reward model's scoring: a sequence-classification model (num_labels=1) reads rendered
conversations in batches, and its raw scores become rewards through the normalization."""

from dataclasses import dataclass

from rlkit.envs.reward_models.model_dirs import REWARD_MODEL, load_model
from rlkit.envs.reward_models.normalize import Normalizer


@dataclass(frozen=True)
class Score:
    raw: float  # the model's output
    reward: float  # after the normalization
    truncated: bool  # the conversation was longer than max_length: its start was cut


class SequenceScorer:
    """Loads the model on `device`. Each conversation is tokenized as rendered (special tokens
    only where the text is plain), cut to its last max_length tokens (the response is what is
    scored), right-padded with the model's pad id: the model reads each row's score at its last
    token that is not that id."""

    def __init__(self, model_path: str, device: str, dtype: str, max_length: int | None, plain_text: bool,
                 normalizer: Normalizer):
        from rlkit.models.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(REWARD_MODEL, model_path, device, dtype, f"reward model {model_path}")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.pad_id, self.device, self.plain_text = self.model.config.pad_token_id, device, plain_text
        self.max_length = max_length or self.model.config.max_position_embeddings
        self.normalizer = normalizer

    def __call__(self, texts: list[str]) -> list[Score]:
        import torch

        rows = self.tokenizer(texts, add_special_tokens=self.plain_text)["input_ids"]
        kept = [ids[-self.max_length:] for ids in rows]
        width = max(len(ids) for ids in kept)
        input_ids = torch.full((len(kept), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, ids in enumerate(kept):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            attention[i, :len(ids)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device)).logits
        raw = logits[:, 0].float().tolist()
        return [Score(r, reward, len(ids) > self.max_length) for r, reward, ids in zip(raw, self.normalizer(raw), rows)]
