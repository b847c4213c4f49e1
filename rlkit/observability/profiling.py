"""torch.profiler around chosen calls of a worker's methods, to see where a step's time goes:

    RLKIT_PROFILE_DIR=prof RLKIT_PROFILE_CALLS=3,4 rlkit train ...

profiles the 3rd and 4th call of each method marked @profiled, on the first rank of each worker
group, and writes <dir>/<Class>.<method>.<call>.txt: the operators by their own GPU time and by
their own CPU time, and the call's wall time. Without RLKIT_PROFILE_DIR a marked method runs as is
(one environment lookup per call)."""

import collections
import functools
import os
import time
from pathlib import Path

import torch

ROWS = 30


def profiled(method):
    """Profile the calls of `method` that RLKIT_PROFILE_CALLS numbers (1-based, default 3: after
    warm-up) when RLKIT_PROFILE_DIR is set, on the instance whose `rank` is 0 (or has none); the
    calls are counted per instance."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        folder = os.environ.get("RLKIT_PROFILE_DIR")
        counts = self.__dict__.setdefault("_profiled_calls", collections.Counter())
        counts[method.__name__] += 1
        number = counts[method.__name__]
        if not folder or getattr(self, "rank", 0) != 0 or number not in wanted_calls():
            return method(self, *args, **kwargs)
        name = f"{type(self).__name__}.{method.__name__}.{number}"
        with torch.profiler.profile(activities=profiler_activities()) as profile:
            start = time.perf_counter()
            result = method(self, *args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        write_tables(Path(folder) / f"{name}.txt", name, seconds, profile)
        return result

    return wrapper


def wanted_calls() -> set[int]:
    return {int(n) for n in os.environ.get("RLKIT_PROFILE_CALLS", "3").split(",") if n.strip()}


def profiler_activities() -> list:
    cuda = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    return [torch.profiler.ProfilerActivity.CPU, *cuda]


def write_tables(path: Path, name: str, seconds: float, profile) -> None:
    averages = profile.key_averages()
    sorts = (["self_device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
    tables = [f"{name}: {seconds:.4f} s wall (profiled)"]
    tables += [f"by {key}:\n{averages.table(sort_by=key, row_limit=ROWS)}" for key in sorts]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(tables) + "\n")
