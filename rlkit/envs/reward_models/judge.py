"""An LLM judge as an environment: a generative model reads a rubric holding the prompt and the
response (and the row's ground truth, if the rubric asks for it), writes a verdict, and the score
read from it, normalized to [0, 1] or as written, is the reward."""

import functools
import math
import re
from pathlib import Path

from rlkit.envs.base import EnvStep
from rlkit.envs.reward_models.generator import BACKENDS, HFGenerator, VLLMGenerator, pick_backend
from rlkit.envs.reward_models.model_dirs import CAUSAL_LM, dtype_problem, model_dir_problem, tokenizer_problem
from rlkit.envs.reward_models.server import ServedModelEnv, ServerSettings
from rlkit.envs.reward_models.verdict import VERDICT_FORMATS, normalized, parse_verdict

DEFAULT_TEMPLATE = ("Grade the answer to the question below for correctness and helpfulness.\n\n"
                    "Question:\n{prompt}\n\nAnswer:\n{response}\n\n"
                    "Reply with one line, a score from 0 (useless) to 10 (perfect): Score: <n>/10")
PLACEHOLDERS = ("prompt", "response", "reference")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def render_template(template: str, values: dict[str, str]) -> str:
    """The template with each {prompt}, {response} and {reference} replaced by its value, in one
    pass (a response that writes "{reference}" stays as written); other braces are kept."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), template)


def template_problem(key: str, template: str) -> str | None:
    names = set(_PLACEHOLDER.findall(template))
    if "response" not in names:
        return f"{key}: the rubric has no {{response}} (got: {template!r:.100}); write {{response}} where the " \
               f"judge reads the answer"
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        return f"{key}: unknown placeholder {{{unknown[0]}}}; the rubric may use {{prompt}}, {{response}} and " \
               f"{{reference}} (the row's answer)"
    return None


def read_template(template: str, template_file: str | None) -> str:
    return Path(template_file).read_text() if template_file else template


class JudgeEnv(ServedModelEnv):
    """Single turn. model_path: a local directory saved by AutoModelForCausalLM with its
    tokenizer (its chat template, if it has one, wraps the rubric as a user turn). template: the
    rubric, with {prompt} (the last user turn), {response} and optionally {reference}
    (metadata["answer"]); template_file, when set, holds it instead. verdict: auto | json |
    score_line (verdict.py). The score must lie in [min_score, max_score]; normalize maps it to
    [0, 1]. A verdict missing, malformed or out of range scores failure_reward and is a fault
    (env_runner.fail_fast stops the run at the first), counted in judge/failures and
    judge/<kind>. backend: auto | hf | vllm (generator.py). cache_size: answers the server keeps
    for identical rubrics (the judge is greedy). The server's keys: ServerSettings.

    Each step reports judge/cache_hits and, for a readable verdict, judge/score_sum and
    judge/scored."""

    service = "judge"

    def __init__(self, model_path: str, template: str = DEFAULT_TEMPLATE, template_file: str | None = None,
                 verdict: str = "auto", min_score: float = 0.0, max_score: float = 10.0, normalize: bool = True,
                 failure_reward: float = 0.0, max_new_tokens: int = 64, backend: str = "auto", dtype: str = "auto",
                 num_gpus: float = 0.0, batch_size: int = 16, max_wait_s: float = 0.02, cache_size: int = 4096,
                 timeout_s: float = 8.0, load_timeout_s: float = 300.0):
        self.model_path, self.template = model_path, read_template(template, template_file)
        self.verdict, self.min_score, self.max_score, self.normalize = verdict, min_score, max_score, normalize
        self.failure_reward, self.max_new_tokens, self.cache_size = failure_reward, max_new_tokens, cache_size
        self.backend, self.dtype = pick_backend(backend, num_gpus), dtype
        self.settings = ServerSettings(num_gpus, batch_size, max_wait_s, timeout_s, load_timeout_s)
        self.uses_reference = "reference" in _PLACEHOLDER.findall(self.template)

    @classmethod
    def check_host(cls, *, backend, num_gpus, **_) -> str | None:
        if pick_backend(backend, num_gpus) == "vllm" and num_gpus:  # without a GPU: check_arguments says so
            try:
                import vllm  # noqa: F401
            except ImportError:
                return "vLLM (env.backend=vllm, or auto with env.num_gpus > 0) is not installed; pip install vllm, " \
                       "or set env.backend=hf"
        return None

    @classmethod
    def check_arguments(cls, *, model_path, template, template_file, verdict, min_score, max_score, max_new_tokens,
                        backend, dtype, num_gpus, batch_size, max_wait_s, cache_size, timeout_s, load_timeout_s,
                        **_) -> str | None:
        for key, value, choices in [("verdict", verdict, VERDICT_FORMATS), ("backend", backend, BACKENDS)]:
            if value not in choices:
                return f"env.{key}: must be one of {list(choices)} (got: {value!r}); pick one of those"
        if not (math.isfinite(min_score) and math.isfinite(max_score) and min_score < max_score):
            return f"env.min_score: the range [{min_score}, {max_score}] is empty; give min_score < max_score " \
                   f"(env.max_score), as the rubric asks"
        if max_new_tokens < 1:
            return f"env.max_new_tokens: must be >= 1 (got: {max_new_tokens}); give the tokens a verdict may take"
        if cache_size < 0:
            return f"env.cache_size: must be >= 0 (got: {cache_size}); 0 keeps no answers"
        if pick_backend(backend, num_gpus) == "vllm" and not num_gpus:
            return "env.backend: vllm needs a GPU; set env.num_gpus=1, or env.backend=hf"
        if template_file is not None:
            try:
                template = Path(template_file).read_text()
            except OSError as e:
                return f"env.template_file: cannot read {template_file} ({e.strerror}); give the rubric's file"
        key = "env.template_file" if template_file is not None else "env.template"
        return (template_problem(key, template)
                or ServerSettings(num_gpus, batch_size, max_wait_s, timeout_s, load_timeout_s).problem()
                or dtype_problem(dtype) or model_dir_problem("env.model_path", model_path, CAUSAL_LM)
                or tokenizer_problem("env.model_path", model_path, needs_chat_template=False))

    def loader(self):
        if self.backend == "vllm":
            return functools.partial(VLLMGenerator, self.model_path, self.dtype, self.max_new_tokens,
                                     self.settings.num_gpus)
        device = "cuda" if self.settings.num_gpus else "cpu"
        return functools.partial(HFGenerator, self.model_path, device, self.dtype, self.max_new_tokens)

    def judge_prompt(self, messages: list[dict], metadata: dict) -> str:
        """The rubric filled in, as the judge model reads it."""
        values = {"prompt": next((m["content"] for m in reversed(messages[:-1]) if m["role"] == "user"), ""),
                  "response": messages[-1]["content"]}
        if self.uses_reference:
            if "answer" not in metadata:
                raise KeyError("the judge's rubric uses {reference}, the row's answer (data.answer_field), and this "
                               "row has none")
            values["reference"] = str(metadata["answer"])
        rubric = render_template(self.template, values)
        if not self.tokenizer.chat_template:
            return rubric
        return self.tokenizer.apply_chat_template([{"role": "user", "content": rubric}], tokenize=False,
                                                  add_generation_prompt=True)

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        answer, cached = self.model.request(self.judge_prompt(messages, metadata))
        verdict = parse_verdict(answer, self.verdict, self.min_score, self.max_score)
        counts = {"judge/cache_hits": int(cached)}
        if verdict.failure:
            return EnvStep(reward=self.failure_reward, done=True, faults=[f"judge verdict {verdict.failure}: "
                                                                          f"{verdict.detail}"],
                           counts={**counts, "judge/failures": 1, f"judge/{verdict.failure}": 1})
        score = normalized(verdict.score, self.min_score, self.max_score) if self.normalize else verdict.score
        return EnvStep(reward=score, done=True, counts={**counts, "judge/score_sum": score, "judge/scored": 1})
