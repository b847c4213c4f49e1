"""RL prompts: rows from a file, the hub or a generated preset (data.*), each mapped to a chat
prompt and the sample's info for the environment, and rendered to token ids once, at load.

A row's `data.prompt_field` holds the prompt (text, or a chat `messages` list); every other field
reaches the environment as the sample's metadata, with `data.answer_field` (the ground truth)
under "answer". Rendering goes through the tokenizer's chat template (data.chat_template), or is
the raw text for base models and the tiny demos.
"""

import functools
import json
import logging
from dataclasses import dataclass

from rlkit.config.schema import ConfigError, PromptDataConfig
from rlkit.data.files import load_rows
from rlkit.data.synthetic import write_generated_sets
from rlkit.data.truncation import head_for_tokens

log = logging.getLogger("rlkit")


# a stand-in conversation whose assistant content no real text contains, to locate template text
_MARKER = "\u2063rlkit\u2063"
_PROBE_TURNS = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARKER}]


@dataclass(frozen=True)
class Prompt:
    messages: list[dict]  # the conversation so far, as the environment sees it
    token_ids: list[int]  # the rendered prompt, generation prompt included
    metadata: dict  # every other field of the row; the ground truth under "answer"


class PromptRenderer:
    """Token ids of prompts and of environment turns, chat-templated or raw.

    Multi-turn episodes grow by appending tokens: the model's own tokens are never re-tokenized
    (decoding and re-encoding them can merge or drop separators), and each environment turn adds
    what the chat template renders after an assistant message: the end of that message the model
    did not generate itself (e.g. the newline after <|im_end|>, or the whole end-of-turn when it
    ran out of tokens), then the user turn and the next generation prompt.
    """

    def __init__(self, tokenizer, chat_template: bool, system_prompt: str | None, prompt_format: str,
                 observation_format: str, tools: list[dict] | None = None, tool_prompt: str = "chat_template"):
        """tools: the environment's tool schemas, shown to the model by the chat template
        (tool_prompt "chat_template") or written into the system message (tool_prompt
        "system_prompt": templates that ignore apply_chat_template(tools=...))."""
        self.tokenizer, self.chat_template, self.tools = tokenizer, chat_template, tools
        self.tool_prompt = tool_prompt
        self.system_prompt, self.prompt_format, self.observation_format = system_prompt, prompt_format, observation_format
        if chat_template:
            # what the template writes after an assistant message's content, found with a marker
            rendered = self._render(_PROBE_TURNS, False)
            self._assistant_end = self._ids(rendered[rendered.rindex(_MARKER) + len(_MARKER):])
            self._base_text = rendered

    @classmethod
    def of(cls, tokenizer, data: PromptDataConfig, observation_format: str,
           tools: list[dict] | None = None) -> "PromptRenderer":
        return cls(tokenizer, data.chat_template, data.system_prompt, data.prompt_format, observation_format, tools,
                   data.tool_prompt)

    def messages(self, prompt: str | list[dict]) -> list[dict]:
        """The prompt as a conversation: the system prompt first (if any), and the last user
        message formatted with data.prompt_format."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] = self.prompt_format.format(prompt=messages[last_user]["content"])
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.tools and self.tool_prompt == "system_prompt":
            if messages[0]["role"] == "system":
                messages[0]["content"] += "\n\n" + tools_system_text(self.tools)
            else:
                messages.insert(0, {"role": "system", "content": tools_system_text(self.tools)})
        return messages

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The chat template with its generation prompt; raw: the one message's text."""
        if self.chat_template:
            return self._ids(self._render(messages, True))
        return self.tokenizer("".join(m["content"] for m in messages))["input_ids"]

    def tools_problem(self) -> str | None:
        """Why the model would never see the tools, or None: raw prompts, or a chat template that
        ignores apply_chat_template(tools=...)."""
        if not self.chat_template:
            return "raw prompts (data.chat_template=false) cannot show them; set data.chat_template=true"
        if self.tool_prompt == "system_prompt":
            return None
        probe = [{"role": "user", "content": "q"}]
        shown = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, tools=self.tools)
        if shown == self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True):
            return ("the tokenizer's chat template ignores them (it renders nothing for apply_chat_template(tools=...)); "
                    "set data.tool_prompt=system_prompt to list them in the system message, or use a model whose "
                    "template shows tools")
        return None

    def appended_ids(self, generated: list[int], messages: list[dict]) -> list[int]:
        """Tokens appended after the model's `generated` tokens for the environment's next turn:
        a user observation or tool results (role "tool"), as the template renders them after an
        assistant turn; raw: each message's content in env_runner.observation_format."""
        if not self.chat_template:
            return [i for m in messages for i in self._ids(self.observation_format.format(observation=m["content"]))]
        end = self._assistant_end
        done = max(k for k in range(len(end) + 1) if k <= len(generated) and generated[len(generated) - k:] == end[:k])
        rendered = self._render(_PROBE_TURNS + messages, True)
        if not rendered.startswith(self._base_text):
            raise ValueError(f"the tokenizer's chat template renders earlier turns differently once a "
                             f"{messages[0]['role']} turn follows, so turns cannot be appended; use "
                             f"data.chat_template=false or another template")
        return end[done:] + self._ids(rendered[len(self._base_text):])

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        shown = self.tools if self.tool_prompt == "chat_template" else None
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  tools=shown)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def tools_system_text(tools: list[dict]) -> str:
    """The tools as data.tool_prompt=system_prompt lists them: one JSON schema per line, then the
    call format the Hermes parser reads (rlkit/envs/tools/parsing.py)."""
    schemas = "\n".join(json.dumps(t, separators=(",", ":")) for t in tools)
    return ("You can call these tools, given as JSON schemas:\n" + schemas + "\nTo call one, write "
            '<tool_call>{"name": "<tool>", "arguments": {<its arguments as JSON>}}</tool_call>. '
            "Each result comes back in the next message. Answer once you have what you need.")


def load_prompt_splits(d: PromptDataConfig, renderer: PromptRenderer) -> tuple[list[Prompt], list[Prompt]]:
    """(train, validation) prompts of data.train_path / data.val_path, or of the set data.synthetic
    generates (written there too: rewritten only when it differs, never over a file rlkit did not
    write). Prompts longer than data.max_prompt_tokens are dropped, with the count in the log."""
    generated = write_generated_sets(d) if d.synthetic is not None else {}
    splits = []
    for key, path, split in [("data.train_path", d.train_path, d.train_split),
                             ("data.val_path", d.val_path, d.val_split)]:
        if path is None:
            splits.append([])
            continue
        try:
            rows = generated[key] if key in generated else load_rows(path, d.max_row_bytes, split, d.subset)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
        prompts = [_prompt(row, f"{path} row {i}", d, renderer) for i, row in enumerate(rows)]
        kept = [p for p in prompts if len(p.token_ids) <= d.max_prompt_tokens]
        if len(kept) < len(prompts):
            log.info("data: dropped %d of %d prompts of %s longer than data.max_prompt_tokens=%d",
                     len(prompts) - len(kept), len(prompts), path, d.max_prompt_tokens)
        if not kept:
            raise ConfigError(f"{key}: every prompt of {path} is longer than data.max_prompt_tokens="
                              f"{d.max_prompt_tokens} tokens; raise data.max_prompt_tokens")
        splits.append(kept)
    train, val = splits
    return train, val if d.val_size is None else val[:d.val_size]


def _prompt(row: dict, where: str, d: PromptDataConfig, renderer: PromptRenderer) -> Prompt:
    for key, name in [("data.prompt_field", d.prompt_field), ("data.answer_field", d.answer_field)]:
        if name is not None and row.get(name) is None:
            raise ConfigError(f"{where} has no field '{name}' ({key}); add it to every row or set {key} to the "
                              f"row's field (fields: {sorted(k for k, v in row.items() if v is not None)})")
    prompt = row[d.prompt_field]
    if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise ConfigError(f"{where}: field '{d.prompt_field}' (data.prompt_field) must be a string or a list of "
                          f"{{'role', 'content'}} messages with a user message (got: {type(prompt).__name__})")
    if not renderer.chat_template and not isinstance(prompt, str):
        raise ConfigError(f"{where}: field '{d.prompt_field}' is a messages list, which needs "
                          f"data.chat_template=true to render")
    metadata = {k: v for k, v in row.items() if k != d.prompt_field}
    if d.answer_field is not None:
        metadata["answer"] = row[d.answer_field]
    # only the head of a long prompt is tokenized: cut, it is still too long and dropped by the caller
    cut = functools.partial(head_for_tokens, renderer.tokenizer, tokens=d.max_prompt_tokens)
    prompt = cut(prompt) if isinstance(prompt, str) else [{**m, "content": cut(m["content"])} for m in prompt]
    messages = renderer.messages(prompt)
    return Prompt(messages, renderer.prompt_ids(messages), metadata)


def _is_messages(value) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)
            and any(m.get("role") == "user" for m in value))
