"""The LLM judge's pure parts: reading a verdict (good, malformed, out of range, empty) and filling
in the rubric, and the rubric's checks at config load."""

import pytest

from rlkit.envs.reward_models.generator import vllm_memory_share
from rlkit.envs.reward_models.judge import render_template, template_problem
from rlkit.envs.reward_models.verdict import Verdict, normalized, parse_verdict


@pytest.mark.parametrize("text, verdict_format, score", [
    ("The answer is right.\nScore: 7/10", "auto", 7.0),
    ("Score: 7", "score_line", 7.0),
    ("**Score:** 8.5 / 10.", "auto", 8.5),
    ("score = 3", "auto", 3.0),
    ("Score: 2/10 at first, but on reflection... Score: 9/10", "auto", 9.0),  # the last verdict counts
    ('{"score": 6, "reason": "ok"}', "json", 6.0),
    ('Reasoning first. {"verdict": {"score": 4}}', "auto", 4.0),
    ('{"score": "5"}', "auto", 5.0),
    ('{"score": 1} then {"score": 10}', "json", 10.0),
    ('Score: 3/10 but {"score": 8}', "auto", 8.0),  # auto prefers the JSON verdict
    ("Score: 0", "auto", 0.0),
    ('{"score": 7}', "score_line", 7.0),  # a quoted score word reads as a line too
])
def test_a_readable_verdict_gives_its_score(text, verdict_format, score):
    assert parse_verdict(text, verdict_format, 0.0, 10.0) == Verdict(score)


@pytest.mark.parametrize("text, verdict_format, failure", [
    ("", "auto", "missing"),
    ("   \n", "auto", "missing"),
    ("The answer looks fine to me.", "auto", "missing"),
    ("Score: 7/10", "json", "missing"),  # a score line is not what json reads
    ("Score: seven", "auto", "malformed"),
    ("Score: 4/5", "auto", "malformed"),  # another scale than the rubric's
    ("Score: 4/five", "auto", "malformed"),
    ('{"score": "high"}', "auto", "malformed"),
    ('{"score": true}', "auto", "malformed"),
    ('{"score": NaN}', "auto", "malformed"),
    ('{"score": 7', "json", "malformed"),  # cut off: a JSON verdict that does not parse
    ("Score: 11/10", "auto", "out_of_range"),
    ("Score: -1", "auto", "out_of_range"),
    ('{"score": 10.5}', "json", "out_of_range"),
])
def test_an_unreadable_verdict_is_a_failure_of_its_kind(text, verdict_format, failure):
    verdict = parse_verdict(text, verdict_format, 0.0, 10.0)
    assert verdict.score is None and verdict.failure == failure and verdict.detail


def test_a_cut_off_json_verdict_still_reads_as_a_score_line_in_auto():
    assert parse_verdict('Score: 6/10 {"score": 6', "auto", 0.0, 10.0) == Verdict(6.0)
    assert parse_verdict('{"score": 6', "auto", 0.0, 10.0) == Verdict(6.0)


def test_the_range_is_the_configured_one():
    assert parse_verdict("Score: 5/5", "auto", 1.0, 5.0) == Verdict(5.0)
    assert parse_verdict("Score: 0", "auto", 1.0, 5.0).failure == "out_of_range"
    assert normalized(4.0, 1.0, 5.0) == 0.75 and normalized(0.0, 0.0, 10.0) == 0.0


def test_the_rubric_is_filled_in_one_pass():
    template = 'Q: {prompt}\nA: {response}\nTruth: {reference}\nReply {"score": n}'
    values = {"prompt": "2+2?", "response": "I say {reference}", "reference": "4"}
    assert render_template(template, values) == 'Q: 2+2?\nA: I say {reference}\nTruth: 4\nReply {"score": n}'


@pytest.mark.parametrize("template, problem", [
    ("Rate: {prompt}", "no {response}"),
    ("Rate {response} against {answer}", "unknown placeholder {answer}"),
    ("", "no {response}"),
])
def test_a_rubric_without_the_response_or_with_unknown_placeholders_is_refused(template, problem):
    line = template_problem("env.template", template)
    assert line.startswith("env.template: ") and problem in line and "\n" not in line


def test_a_rubric_with_its_placeholders_passes():
    assert template_problem("env.template", 'Q {prompt} A {response} R {reference} {"score": 1}') is None


@pytest.mark.parametrize("num_gpus, share", [(0.1, 0.1), (0.5, 0.5), (1, 0.9), (2, 0.9)])
def test_a_vllm_judge_takes_its_share_of_a_shared_gpus_memory(num_gpus, share):
    # below one GPU the judge sits beside the colocated policy and engine: vLLM's default 0.9 would not fit
    assert vllm_memory_share(num_gpus) == share
