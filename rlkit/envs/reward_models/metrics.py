"""Means of the model rewards' scores. A step's counts add up over the episodes, so a score is
reported as <namespace>/<name>_sum beside <namespace>/scored (the episodes that got one); their
quotient is the mean, <namespace>/<name>: e.g. reward_model/raw, judge/score, combined/<part>."""


def score_means(metrics: dict[str, float]) -> dict[str, float]:
    means = {}
    for key, total in metrics.items():
        namespace, _, name = key.rpartition("/")
        scored = metrics.get(f"{namespace}/scored")
        if name.endswith("_sum") and scored:
            means[f"{namespace}/{name.removesuffix('_sum')}"] = total / scored
    return means
