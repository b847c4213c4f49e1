"""What `rlkit eval` reports, as pure functions: pass@k, the report's figures from each prompt's
sampled verdicts, and the console table. The workers' side is rlkit/launch/evaluate.py."""

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct:
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold at
    least one correct one (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    eq. 1). Exact integer binomials, so it holds for large n."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (got k={k}, n={n})")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n (got c={c}, n={n})")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct: list[list[bool]], k: int) -> float:
    """pass@k averaged over prompts; correct[i]: the verdicts of prompt i's n samples."""
    return sum(pass_at_k(len(samples), sum(samples), k) for samples in correct) / len(correct)


def parse_ks(text: str, n: int) -> list[int]:
    """--k "1,4,8" as sorted distinct ints, each in 1..n; a ValueError saying what is wrong."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--k: a comma-separated list of integers, e.g. 1,4,8 (got: {text!r})") from None
    if not ks:
        raise ValueError(f"--k: give at least one k (got: {text!r})")
    if ks[0] < 1 or ks[-1] > n:
        raise ValueError(f"--k: each k must be in 1..--n={n} (got: {text}); pass@k needs n >= k samples per "
                         f"prompt: raise --n or lower --k")
    return ks


def report_table(report: dict) -> str:
    """The report on one screen: what was evaluated, then one figure a line."""
    greedy, sampled = report["greedy"], report.get("sampled")
    step = f" (step {report['step']})" if report.get("step") is not None else ""
    rows = [("greedy accuracy", _accuracy(greedy)), ("greedy mean reward", f"{greedy['reward']:.3f}"),
            ("greedy response length", f"{greedy['response_length']:.1f} tokens")]
    if sampled is not None:
        at = f"n={sampled['n']}, temperature {sampled['temperature']:g}"
        rows += [(f"{key} ({at})", f"{value:.3f}") for key, value in sampled.items() if key.startswith("pass@")]
        rows += [("sampled accuracy", _accuracy(sampled)), ("sampled mean reward", f"{sampled['reward']:.3f}"),
                 ("sampled response length", f"{sampled['response_length']:.1f} tokens")]
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"rlkit eval: {report['model']}{step}",
                      f"  {report['prompts']} prompts of {report['data']}, reward from {report['env']}",
                      *(f"  {name:<{width}}  {value}" for name, value in rows),
                      f"  {report['seconds']:.1f} s"])


def _accuracy(figures: dict) -> str:
    """The accuracy and how many episodes had a verdict (an environment that failed gives none)."""
    if figures.get("accuracy") is None:
        return "n/a (the environment gave no verdicts)"
    return f"{figures['accuracy']:.3f} ({figures['scored']} scored)"
