"""Rewards combined by weights: several single-turn environments (rules, a reward model, a judge)
score the same response, and the reward is their weighted sum. Each part's own reward is
reported beside it (combined/<part>_sum), so a model reward that rises while a rule's check does
not shows as it happens."""

from typing import NamedTuple

from rlkit.envs.base import (EnvStep, Environment, as_env_step, check_environment_config, load_environment,
                             start_services)


def weighted_sum(rewards: dict[str, float], weights: dict[str, float]) -> float:
    return sum(weights[name] * reward for name, reward in rewards.items())


class Part(NamedTuple):
    target: str  # its environment class or scoring function
    weight: float  # its weight in the sum
    kwargs: dict  # its constructor's keywords


def split_part(part: dict) -> Part:
    return Part(part["_target_"], float(part["weight"]),
                {k: v for k, v in part.items() if k not in ("_target_", "weight")})


def parts_problem(parts: dict) -> str | None:
    """Why env.parts is not a mapping of names to {_target_, weight, <its keys>}, or None."""
    if not isinstance(parts, dict) or not parts:
        return f"env.parts: give the environments to combine, name -> {{_target_, weight, <its keys>}} " \
               f"(got: {parts!r:.100})"
    for name, part in parts.items():
        if not isinstance(part, dict) or "_target_" not in part:
            return f"env.parts.{name}: give its environment as _target_ (got: {part!r:.100})"
        weight = part.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            return f"env.parts.{name}.weight: give the part's weight in the sum, a number (got: {weight!r})"
    return None


class CombinedEnv(Environment):
    """parts: name -> {_target_: an environment class or scoring function, weight: its weight
    in the sum, and its own env keys}. Every part must answer in one turn. The verdict (correct,
    train/accuracy) is the first part's that gives one, in the order listed; faults are the
    parts' own, each led by its part's name; their counts add up beside combined/<part>_sum
    (the part's unweighted reward) and combined/scored. A part that fails fails the sample."""

    def __init__(self, parts: dict):
        split = {name: split_part(part) for name, part in parts.items()}
        self.weights = {name: part.weight for name, part in split.items()}
        self.parts = {name: load_environment(part.target, part.kwargs) for name, part in split.items()}

    @classmethod
    def check_arguments(cls, *, parts, **_) -> str | None:
        problem = parts_problem(parts)
        if problem:
            return problem
        for name, part in parts.items():
            target, _, kwargs = split_part(part)
            problem = check_environment_config(target, kwargs)
            if problem:  # its keys are env.<key> for the part alone
                return f"env.parts.{name}.{problem.removeprefix('env.')}"
        return None

    @classmethod
    def start_services(cls, *, parts, **_) -> dict:
        services = {}
        for name, part in parts.items():
            target, _, kwargs = split_part(part)
            services.update({f"{name}/{key}": service for key, service in start_services(target, kwargs).items()})
        return services

    def setup(self) -> None:
        for name, env in self.parts.items():
            env.services = {key.removeprefix(f"{name}/"): service for key, service in self.services.items()
                            if key.startswith(f"{name}/")}
            env.setup()

    def step(self, messages: list[dict], metadata: dict) -> EnvStep:
        steps = {name: as_env_step(env.step(messages, metadata)) for name, env in self.parts.items()}
        counts, faults = {"combined/scored": 1}, []
        for name, step in steps.items():
            if not step.done:
                raise ValueError(f"env.parts.{name} answered with another turn; CombinedEnv combines single-turn "
                                 f"rewards")
            counts[f"combined/{name}_sum"] = step.reward
            for key, value in (step.counts or {}).items():
                counts[key] = counts.get(key, 0) + value
            faults += [f"{name}: {fault}" for fault in step.faults or []]
        rewards = {name: step.reward for name, step in steps.items()}
        correct = next((step.correct for step in steps.values() if step.correct is not None), None)
        return EnvStep(reward=weighted_sum(rewards, self.weights), done=True, correct=correct, counts=counts,
                       faults=faults or None)
