"""A policy loss of one's own, named in algorithm.policy_loss as "module:attribute": gpg_loss below,
which nothing in rlkit knows, becomes the objective the trainer builds; the built-in `clipped` gives
the objective the trainer built before the key existed, with every variant key; a wrong name is one
config error line before any worker starts; docs/algorithms.md's example loss loads from the
directory rlkit starts in. tests/integration/test_own_policy_loss.py trains two GRPO steps with
gpg_loss."""

import re
import sys
from pathlib import Path

import pytest
import torch

from rlkit.algorithms.losses import ClippedPolicyLossConfig, aggregate, clipped_policy_loss
from rlkit.algorithms.objectives import PolicyGradient
from rlkit.algorithms.policy_gradient import kl_estimator, max_response_tokens, policy_objective
from rlkit.cli import main
from rlkit.config.schema import ConfigError
from rlkit.data.batch import Batch, batch_totals
from rlkit.launch.config import load_config

RECIPE = "grpo_tiny_cpu"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def gpg_loss(logprobs, old_logprobs, advantages, mask, cfg, totals, **optional):
    """The plain policy gradient (REINFORCE on the given advantages, as GPG uses it): -A log pi per
    token, no ratio and no clip, aggregated as algorithm.loss_aggregation says. Its sum:
    pushed_tokens, the response tokens whose advantage is not 0."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    keep = mask.bool()
    logprobs = torch.where(keep, logprobs, torch.zeros_like(logprobs))  # padding may hold inf
    loss = aggregate(-advantages * logprobs, mask, cfg.aggregation, totals, cfg.max_response_tokens)
    return loss, {"pushed_tokens": ((advantages != 0) & keep).float().sum().detach()}


def loss_without_entropy(logprobs, old_logprobs, advantages, mask, cfg, totals, reference_logprobs=None,
                         off_policy_weights=None):
    return logprobs.sum(), {}


OWN = f"{__name__}:gpg_loss"  # this module, by the name it was imported under


def test_the_named_function_is_the_objective_the_trainer_builds():
    cfg, _ = load_config(RECIPE, [f"algorithm.policy_loss={OWN}", "algorithm.loss_aggregation=seq-mean-token-mean"])
    objective = policy_objective(cfg, kl_in_loss=True)
    assert objective.loss_function is gpg_loss
    logprobs = torch.tensor([[-9.0, -1.0, -2.0], [-9.0, -0.5, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    batch = Batch({"response_mask": mask, "old_logprobs": torch.zeros(2, 3), "advantages": torch.tensor([1.0, 0.0])})
    loss, sums = objective(logprobs, batch, batch_totals(mask))
    # sequence 1: -1 x mean(-1, -2) = 1.5; sequence 2: advantage 0; mean over the 2 sequences
    assert loss.item() == pytest.approx(0.75) and sums == {"pushed_tokens": 2.0}
    loss.backward()
    assert torch.equal(logprobs.grad, torch.tensor([[0.0, -0.25, -0.25], [0.0, 0.0, 0.0]]))


def objective_before_the_key(cfg, kl_in_loss: bool) -> PolicyGradient:
    """The objective PolicyGradientTrainer built before algorithm.policy_loss existed."""
    a = cfg.algorithm
    return PolicyGradient(ClippedPolicyLossConfig(
        a.clip_low, a.clip_high, a.kl_coef if kl_in_loss else 0.0, a.loss_aggregation, a.dual_clip_c,
        kl_estimator(a, in_loss=True), a.importance_ratio, max_response_tokens(cfg), a.entropy_coef),
        off_policy_weighted=a.off_policy_correction != "none")


@pytest.mark.parametrize("recipe, overrides", [
    (RECIPE, []),
    (RECIPE, ["algorithm.policy_loss=clipped", "algorithm.dual_clip_c=3.0", "algorithm.kl_coef=0.1",
              "algorithm.kl_estimator=k3+", "algorithm.entropy_coef=0.01"]),
    (RECIPE, ["algorithm.importance_ratio=sequence", "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4",
              "algorithm.loss_aggregation=seq-mean-token-sum-norm", "algorithm.off_policy_correction=token_tis"]),
    ("ppo_tiny_cpu", ["algorithm.kl_mode=reward", "algorithm.kl_coef=0.05"]),
], ids=["default", "dual-clip-kl-entropy", "gspo-norm-tis", "ppo-kl-in-reward"])
def test_clipped_builds_the_objective_built_before_the_key(recipe, overrides):
    cfg, _ = load_config(recipe, overrides)
    kl_in_loss = recipe == RECIPE
    objective = policy_objective(cfg, kl_in_loss)
    assert objective == objective_before_the_key(cfg, kl_in_loss)
    assert objective.loss_function is clipped_policy_loss


@pytest.mark.parametrize("value, fragment", [
    ("clipd", "(got: 'clipd')"),
    ("no_such_loss_module:gpg_loss", "No module named 'no_such_loss_module'"),
    (f"{__name__}:gpg", f"module {__name__!r} defines no function 'gpg'"),
    (f"{__name__}:RECIPE", "defines no function 'RECIPE'"),
    (f"{__name__}:loss_without_entropy",
     "cannot be called as a policy loss: got an unexpected keyword argument 'entropy'"),
])
def test_a_wrong_loss_is_one_config_error_line_naming_the_key_and_choices(value, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, [f"algorithm.policy_loss={value}"])
    message = str(info.value)
    assert message.startswith("algorithm.policy_loss: ") and "\n" not in message
    assert fragment in message and f"(got: {value!r})" in message
    assert "['clipped']" in message or "give it the parameters (logprobs, old_logprobs," in message


def test_the_cli_says_a_wrong_loss_in_one_line_before_any_worker_starts(capsys):
    assert main(["train", "--config-name", RECIPE, "algorithm.policy_loss=ppo"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("rlkit: config error: algorithm.policy_loss: must be one of ['clipped'] or ")
    assert len(err.splitlines()) == 1


@pytest.fixture
def docs_loss_folder(tmp_path, monkeypatch):
    """A user's folder holding docs/algorithms.md's my_loss.py, where rlkit starts."""
    code = re.search(r"```python\n(# my_loss\.py.*?)```", DOCS.read_text(), re.DOTALL).group(1)
    (tmp_path / "my_loss.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # rlkit adds the folder; it goes after the test
    yield tmp_path
    sys.modules.pop("my_loss", None)


def test_the_docs_example_loads_from_where_rlkit_starts_and_is_this_loss(docs_loss_folder):
    cfg, _ = load_config(RECIPE, ["algorithm.policy_loss=my_loss:gpg_loss"])
    objective = policy_objective(cfg, kl_in_loss=True)
    assert objective.loss_function.__module__ == "my_loss"
    logprobs, mask = -torch.rand(3, 5, generator=torch.Generator().manual_seed(0)), torch.ones(3, 5)
    batch = Batch({"response_mask": mask, "old_logprobs": logprobs, "advantages": torch.tensor([1.0, 0.0, -2.0])})
    docs_loss, docs_sums = objective(logprobs, batch, batch_totals(mask))
    loss, sums = PolicyGradient(objective.loss, loss_function=gpg_loss)(logprobs, batch, batch_totals(mask))
    assert torch.equal(docs_loss, loss) and docs_sums == sums
