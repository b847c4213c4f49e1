"""SFT and preference data: rows from files or the hub, tokenized with a loss mask.

A row is either {"prompt": str, "response": str} or {"messages": [{"role", "content"}, ...]};
preference rows are {"prompt", "chosen", "rejected"}. Tokenizing gives (input_ids, loss_mask),
two equal-length lists where loss_mask[t] = 1 marks a token the model is trained to produce:
every assistant message's content plus its end-of-turn marker.
"""

import os

from rlkit.config.schema import ConfigError, FileDataConfig
from rlkit.data.files import load_rows
from rlkit.data.synthetic import write_generated_sets
from rlkit.data.truncation import head_for_tokens

ROLES = ("system", "user", "assistant", "tool")


def tokenize_sft_row(tokenizer, row: dict, where: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one SFT row, chat-templated; loss on every assistant turn. Their
    first max_tokens (data.max_length) are exact; what lies past them may be cut short.

    `where` (e.g. "data.train_path row 12") names the row in error messages.
    """
    messages = _row_messages(row, where)
    trained = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not trained:
        raise ValueError(f"{where}: 'messages' has no assistant message to train on; add one")
    return _chat_tokens(tokenizer, messages, trained, where, max_tokens)


def tokenize_preference_row(tokenizer, row: dict, where: str,
                            max_tokens: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(chosen_ids, chosen_mask, rejected_ids, rejected_mask): the prompt as user turn(s) followed by
    each response as an assistant turn; the mask covers only that final response (+ end-of-turn).
    The first max_tokens of each are exact, as in tokenize_sft_row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: is a {type(row).__name__}, not a record; give each row prompt, chosen, rejected")
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt_messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        prompt_messages = _checked_messages(prompt, where, "prompt")
    else:
        raise ValueError(f"{where} lacks 'prompt' (a string or a non-empty messages list); "
                         f"give each row prompt, chosen, rejected")
    out = []
    for field in ("chosen", "rejected"):
        response = row.get(field)
        if not isinstance(response, str):
            raise ValueError(f"{where} {_not_text(row, field)}; give each row prompt, chosen, rejected")
        messages = prompt_messages + [{"role": "assistant", "content": response}]
        out.extend(_chat_tokens(tokenizer, messages, [len(messages) - 1], where, max_tokens))
    return tuple(out)


def _row_messages(row: dict, where: str) -> list[dict]:
    """The row as a checked messages list. A null field counts as missing (parquet files and hub
    datasets fill a column a row lacks with None)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: is a {type(row).__name__}, not a record; give each row prompt+response or messages")
    if row.get("messages") is not None:
        return _checked_messages(row["messages"], where, "messages")
    for field in ("prompt", "response"):
        if not isinstance(row.get(field), str):
            raise ValueError(f"{where} {_not_text(row, field)}; give each row prompt+response or messages")
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def _not_text(row: dict, field: str) -> str:
    """What is wrong with a field that should hold text: absent, or of another type."""
    if row.get(field) is None:
        return f"lacks '{field}' (a string)"
    return f"has '{field}' of type {type(row[field]).__name__} ({row[field]!r:.60}), not a string; quote it"


def _checked_messages(messages, where: str, field: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: '{field}' must be a non-empty list of {{'role', 'content'}} records")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ValueError(f"{where}: '{field}'[{k}] has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: '{field}'[{k}] lacks 'content' (a string); give every message one")
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{where}: '{field}'[0] is an assistant message; start with a system or user message")
    return messages


def _chat_tokens(tokenizer, messages: list[dict], trained: list[int], where: str,
                 max_tokens: int) -> tuple[list[int], list[int]]:
    """Tokens of the chat-templated conversation, with loss on the assistant messages at `trained`;
    each message is first cut to what its first max_tokens tokens need (truncation.py).

    The template is rendered for growing prefixes of the conversation; each trained message k spans
    from the end of render(messages[:k], add_generation_prompt=True) to the end of
    render(messages[:k + 1]). The text between consecutive boundaries is tokenized piece by piece,
    so prompt tokens match what the generation prompt tokenizes to, and a span never shares a token
    with its neighbours. Within a span, template text after the last special token (e.g. the "\\n"
    after <|im_end|>) is not trained on.
    """
    messages = [{**m, "content": head_for_tokens(tokenizer, m["content"], max_tokens)} for m in messages]
    special_ids = set(tokenizer.all_special_ids)
    special_ids |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    full = _render(tokenizer, messages, False)
    boundaries = []  # (character offset, whether the piece ending there is trained)
    for k in trained:
        boundaries += [(_render_prefix(tokenizer, messages, k, True, full, where), False),
                       (_render_prefix(tokenizer, messages, k + 1, False, full, where), True)]
    boundaries.append((len(full), False))
    input_ids, loss_mask, start = [], [], 0
    for end, is_trained in boundaries:
        if end < start:
            raise ValueError(_unstable(where, "the generation prompt is longer than the assistant turn it starts"))
        piece = tokenizer(full[start:end], add_special_tokens=False)["input_ids"] if end > start else []
        mask = [0] * len(piece)
        if is_trained:
            last_special = max((t for t, i in enumerate(piece) if i in special_ids), default=len(piece) - 1)
            mask[:last_special + 1] = [1] * (last_special + 1)
        input_ids += piece
        loss_mask += mask
        start = end
    return input_ids, loss_mask


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _render_prefix(tokenizer, messages, count: int, add_generation_prompt: bool, full: str, where: str) -> int:
    """Length of the rendered first `count` messages, checked to be a prefix of the full rendering."""
    text = _render(tokenizer, messages[:count], add_generation_prompt)
    if not full.startswith(text):
        prompt = " with the generation prompt" if add_generation_prompt else ""
        why = f"messages[:{count}] rendered{prompt} is not a prefix of the whole conversation"
        raise ValueError(_unstable(where, why))
    return len(text)


def _unstable(where: str, why: str) -> str:
    return (f"{where}: the tokenizer's chat template is not prefix-stable ({why}), so assistant tokens cannot be "
            f"located; use a chat template that renders each turn the same whatever follows it")


def load_tokenized_splits(d: FileDataConfig, tokenize) -> tuple[list, list]:
    """Tokenized (train, val) examples of data.train_path / data.val_path, or of the set
    data.synthetic generates (written there too: rewritten only when it differs; never over a
    file rlkit did not write). tokenize(row, where, max_tokens) -> example."""
    generated = write_generated_sets(d) if d.synthetic is not None else {}
    splits = []
    for key, path in [("data.train_path", d.train_path), ("data.val_path", d.val_path)]:
        if path is None:
            splits.append([])
            continue
        try:
            rows = generated[key] if key in generated else load_rows(path, d.max_row_bytes)
            splits.append([tokenize(row, f"{path} row {i}", d.max_length) for i, row in enumerate(rows)])
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
    return splits[0], splits[1]


def file_identity(*paths: str | None) -> tuple:
    """(path, size, mtime) of local files: a warm start cached for other contents is not reused."""
    return tuple((p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths if p and os.path.isfile(p))
