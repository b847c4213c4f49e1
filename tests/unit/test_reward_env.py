"""Model rewards' pure parts: normalization, rewards combined by weights, the score means, the
model server's batching and cache (driven in this process, without Ray), and the config errors of a
reward model, a judge and a combination, each one line naming the key."""

import asyncio
import json
import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlkit.config.schema import ConfigError
from rlkit.envs.base import EnvStep, Environment, check_environment_config, load_environment, start_services
from rlkit.envs.reward_models.combined import CombinedEnv, weighted_sum
from rlkit.envs.reward_models.metrics import score_means
from rlkit.envs.reward_models.model_dirs import is_out_of_memory, out_of_memory_line
from rlkit.envs.reward_models.normalize import Normalizer, RunningMoments
from rlkit.envs.reward_models.server import ModelServer
from rlkit.envs.rules import check_environment
from rlkit.envs.runner import safe_step
from rlkit.models.tiny import build_tokenizer

RM = "rlkit.envs.reward_models.reward_model.RewardModelEnv"
JUDGE = "rlkit.envs.reward_models.judge.JudgeEnv"
COMBINED = "rlkit.envs.reward_models.combined.CombinedEnv"


def conversation(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


# ---- normalization ------------------------------------------------------------------------------------------------

def test_running_moments_equal_the_moments_of_every_score_seen():
    batches = [[1.0, 2.0, 4.0], [10.0], [-3.0, 0.5]]
    moments = RunningMoments()
    for batch in batches:
        moments.add(batch)
    every = [s for batch in batches for s in batch]
    assert moments.count == 6
    assert moments.mean == pytest.approx(statistics.fmean(every))
    assert moments.std == pytest.approx(statistics.pstdev(every))


def test_running_normalization_scales_each_batch_by_everything_so_far():
    normalize = Normalizer("running")
    assert normalize([3.0]) == [0.0]  # a first score is centred on itself
    scores = normalize([1.0, 5.0])
    mean, std = statistics.fmean([3.0, 1.0, 5.0]), statistics.pstdev([3.0, 1.0, 5.0])
    assert scores == pytest.approx([(1.0 - mean) / std, (5.0 - mean) / std])


def test_affine_and_no_normalization():
    assert Normalizer("affine", scale=2.0, shift=-1.0)([0.5, 3.0]) == [0.0, 5.0]
    assert Normalizer("none", scale=2.0)([0.5, 3.0]) == [0.5, 3.0]


# ---- combination ---------------------------------------------------------------------------------------------------

def length_score(response: str, metadata: dict) -> float:
    return float(len(response))


class _Faulty(Environment):
    def step(self, messages, metadata):
        return EnvStep(reward=0.25, done=True, faults=["tool x raised"], counts={"tools/calls": 2})


class _TalksBack(Environment):
    def step(self, messages, metadata):
        return EnvStep(reward=0.0, done=False, observation="again")


PARTS = {"rule": {"_target_": "rlkit.envs.arithmetic.ArithmeticEnv", "weight": 1.0, "correct_reward": 2.0},
         "length": {"_target_": f"{__name__}.length_score", "weight": -0.5},
         "faulty": {"_target_": f"{__name__}._Faulty", "weight": 4}}


def test_weighted_sum():
    assert weighted_sum({"a": 1.0, "b": 3.0}, {"a": 0.5, "b": -2.0}) == -5.5


def test_the_combined_reward_is_the_weighted_sum_and_each_part_is_reported():
    env = load_environment(COMBINED, {"parts": PARTS})
    env.setup()
    right = env.step(conversation("2+3=", "5"), {"answer": "5"})
    assert right.reward == 1.0 * 2.0 - 0.5 * 1 + 4 * 0.25 and right.done and right.correct is True
    assert right.counts == {"combined/scored": 1, "combined/rule_sum": 2.0, "combined/length_sum": 1.0,
                            "combined/faulty_sum": 0.25, "tools/calls": 2}
    assert right.faults == ["faulty: tool x raised"]
    wrong = env.step(conversation("2+3=", "41"), {"answer": "5"})
    assert wrong.reward == 0.0 - 0.5 * 2 + 1.0 and wrong.correct is False


def test_a_part_that_talks_back_is_refused():
    env = CombinedEnv({"rule": PARTS["rule"], "chat": {"_target_": f"{__name__}._TalksBack", "weight": 1.0}})
    with pytest.raises(ValueError, match="env.parts.chat answered with another turn"):
        env.step(conversation("2+3=", "5"), {"answer": "5"})


def test_parts_without_services_start_none():
    assert start_services(COMBINED, {"parts": PARTS}) == {}


def test_score_means_divide_each_sum_by_the_episodes_scored():
    metrics = {"combined/rule_sum": 3.0, "combined/length_sum": 12.0, "combined/scored": 4, "judge/score_sum": 1.5,
               "judge/scored": 0, "env/failures": 2, "train/reward": 0.5}
    assert score_means(metrics) == {"combined/rule": 0.75, "combined/length": 3.0}


# ---- the model server's batching and cache ------------------------------------------------------------------------

class _Recorder:
    """A model that answers each request with its upper case and records the batches it got."""

    def __init__(self, fail_on: str | None = None):
        self.batches, self.fail_on = [], fail_on

    def __call__(self, batch: list[str]) -> list[str]:
        self.batches.append(list(batch))
        if self.fail_on in batch:
            raise RuntimeError(f"cannot score {self.fail_on}")
        return [request.upper() for request in batch]


def serve(server: ModelServer, *rounds: list[str]) -> list[list]:
    """Each round's requests sent at once, as many workers would, one round after the other (in
    one event loop, as in the actor); each answer, or the error it raised."""
    async def send():
        return [await asyncio.gather(*(server.submit(r) for r in requests), return_exceptions=True)
                for requests in rounds]

    return asyncio.run(send())


def test_requests_sent_together_are_answered_in_batches_of_at_most_batch_size():
    model = _Recorder()
    server = ModelServer(lambda: model, batch_size=2, max_wait_s=0.01, cache_size=0)
    assert serve(server, ["a", "b", "c", "d", "e"]) == [[("A", False), ("B", False), ("C", False), ("D", False),
                                                           ("E", False)]]
    assert model.batches == [["a", "b"], ["c", "d"], ["e"]]


def test_a_batch_holding_a_request_from_every_worker_closes_without_waiting():
    """Two registered workers, each with one request out: their batch runs at once, not after
    max_wait_s (an hour; the guard fails the test in a minute instead of hanging it)."""
    model = _Recorder()
    server = ModelServer(lambda: model, batch_size=8, max_wait_s=3600, cache_size=0)

    async def send():
        await server.register()
        await server.register()
        return await asyncio.wait_for(asyncio.gather(server.submit("a"), server.submit("b")), 60)

    assert asyncio.run(send()) == [("A", False), ("B", False)] and model.batches == [["a", "b"]]


def test_identical_requests_are_answered_once_from_the_cache():
    model = _Recorder()
    server = ModelServer(lambda: model, batch_size=8, max_wait_s=0.01, cache_size=2)
    first, second, third = serve(server, ["a", "a", "b"], ["b", "c", "d"], ["a"])
    assert first == [("A", False), ("A", True), ("B", False)]
    assert second == [("B", True), ("C", False), ("D", False)]
    assert third == [("A", False)]  # least recently used: gone from a cache of 2
    assert model.batches == [["a", "b"], ["c", "d"], ["a"]]


def test_a_failed_batch_fails_its_requests_and_the_server_goes_on():
    server = ModelServer(lambda: _Recorder(fail_on="bad"), batch_size=2, max_wait_s=0.01, cache_size=4)
    (first, second, third), again = serve(server, ["ok", "bad", "fine"], ["ok"])
    assert isinstance(first, RuntimeError) and isinstance(second, RuntimeError) and third == ("FINE", False)
    assert again == [("OK", False)]  # a failure is not cached


def test_a_model_that_cannot_load_is_one_line_for_every_worker():
    def load():
        raise MemoryError(out_of_memory_line("reward model /ckpt/rm", "cpu"))

    server = ModelServer(load, batch_size=2, max_wait_s=0.01, cache_size=0)
    problem = asyncio.run(server.ready())
    assert problem.startswith("MemoryError: reward model /ckpt/rm: out of memory loading it on cpu") and \
        "env.num_gpus=1" in problem and "\n" not in problem
    ((error,),) = serve(server, ["a"])
    assert isinstance(error, RuntimeError) and str(error) == problem


@pytest.mark.parametrize("error, oom", [(MemoryError(), True), (torch.OutOfMemoryError("CUDA out of memory."), True),
                                        (RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"), True),
                                        (RuntimeError("size mismatch"), False), (ValueError("out of range"), False)])
def test_out_of_memory_is_told_apart(error, oom):
    assert is_out_of_memory(error) == oom


class _OwnTimeout:
    def step(self, messages, metadata):
        raise TimeoutError("reward model did not answer within 1 s (env.timeout_s)")


def test_a_step_whose_own_wait_times_out_is_a_timeout_that_leaves_its_worker_free():
    outcome, stuck = safe_step(_OwnTimeout(), conversation("q", "a"), {}, 5.0, ThreadPoolExecutor(1))
    assert outcome.failure == "timeout" and not stuck and "env.timeout_s" in outcome.detail


# ---- config errors ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Model directories as their config.json and tokenizer say (no weights: the checks read none)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = build_tokenizer()
    dirs = {}
    for name, architecture, labels in [("rm", "Qwen2ForSequenceClassification", 1),
                                       ("two_labels", "Qwen2ForSequenceClassification", 2),
                                       ("lm", "Qwen2ForCausalLM", 2),
                                       ("no_template", "Qwen2ForSequenceClassification", 1)]:
        path = root / name
        tokenizer.save_pretrained(path)
        (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": [architecture],
                                                      "id2label": {str(i): f"LABEL_{i}" for i in range(labels)}}))
        dirs[name] = str(path)
    (root / "no_template" / "chat_template.jinja").unlink()
    return dirs


def test_a_reward_model_directory_passes(model_dirs):
    assert check_environment_config(RM, {"model_path": model_dirs["rm"], "normalize": "running"}) is None
    assert check_environment_config(RM, {"model_path": model_dirs["no_template"], "chat_template": False}) is None
    assert check_environment_config(JUDGE, {"model_path": model_dirs["lm"]}) is None


@pytest.mark.parametrize("target, kwargs, start, hint", [
    (RM, {"model_path": "/no/such/dir"}, "env.model_path: /no/such/dir is not a local HF model directory",
     "save_pretrained"),
    (RM, {"model_path": "lm"}, "env.model_path: ", "holds no *ForSequenceClassification model"),
    (RM, {"model_path": "two_labels"}, "env.model_path: ", "num_labels=1"),
    (RM, {"model_path": "no_template"}, "env.model_path: ", "env.chat_template=false"),
    (RM, {"model_path": "rm", "normalize": "zscore"}, "env.normalize: must be one of", "pick one"),
    (RM, {"model_path": "rm", "batch_size": 0}, "env.batch_size: must be >= 1", "give"),
    (RM, {"model_path": "rm", "timeout_s": 0}, "env.timeout_s: must be a finite number of seconds > 0", "e.g."),
    (RM, {"model_path": "rm", "dtype": "fp8"}, "env.dtype: must be one of", "auto"),
    (RM, {"model_path": "rm", "max_length": 0}, "env.max_length: must be >= 1", "null"),
    (JUDGE, {"model_path": "rm"}, "env.model_path: ", "holds no *ForCausalLM model"),
    (JUDGE, {"model_path": "lm", "template": "Rate {prompt}"}, "env.template: the rubric has no {response}",
     "write {response}"),
    (JUDGE, {"model_path": "lm", "template_file": "/no/rubric.txt"}, "env.template_file: cannot read /no/rubric.txt",
     "give"),
    (JUDGE, {"model_path": "lm", "min_score": 5.0, "max_score": 5.0}, "env.min_score: the range [5.0, 5.0] is empty",
     "min_score < max_score"),
    (JUDGE, {"model_path": "lm", "verdict": "xml"}, "env.verdict: must be one of", "pick one"),
    (JUDGE, {"model_path": "lm", "backend": "vllm"}, "env.backend: vllm needs a GPU", "env.num_gpus=1"),
    (COMBINED, {"parts": {}}, "env.parts: give the environments to combine", "_target_"),
    (COMBINED, {"parts": {"rule": {"_target_": "rlkit.envs.arithmetic.ArithmeticEnv"}}}, "env.parts.rule.weight: ",
     "a number"),
    (COMBINED, {"parts": {"rule": {"_target_": "rlkit.envs.arithmetic.ArithmeticEnv", "weight": 1, "bonus": 2}}},
     "env.parts.rule.bonus: unknown key", "accepts"),
    (COMBINED, {"parts": {"rm": {"_target_": RM, "weight": 1, "model_path": "lm"}}}, "env.parts.rm.model_path: ",
     "ForSequenceClassification"),
])
def test_bad_model_reward_configs_are_one_line_naming_the_key(model_dirs, target, kwargs, start, hint):
    def resolved(value):  # a model's name in model_dirs -> its directory
        if isinstance(value, dict):
            return {k: resolved(v) for k, v in value.items()}
        return model_dirs.get(value, value) if isinstance(value, str) else value

    line = check_environment_config(target, resolved(kwargs))
    assert line is not None and line.startswith(start) and hint in line and "\n" not in line, line


def test_a_judge_rubric_file_without_the_response_is_refused(model_dirs, tmp_path):
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Rate the question {prompt}. Score: n/10")
    line = check_environment_config(JUDGE, {"model_path": model_dirs["lm"], "template_file": str(rubric)})
    assert line.startswith("env.template_file: the rubric has no {response}")


def test_model_servers_sharing_a_whole_gpu_are_refused_as_the_config_loads(model_dirs):
    part = {"_target_": RM, "weight": 1, "model_path": model_dirs["rm"], "num_gpus": 0.5}
    with pytest.raises(ConfigError, match=r"^env.num_gpus: the model servers' shares below one GPU add up to 1 .*"
                                          r"keep the sum below 1"):
        check_environment({"_target_": COMBINED, "parts": {"a": part, "b": dict(part)}})
