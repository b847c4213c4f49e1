"""Bytes that cross the controller (the Ray driver) per training step, by Ray call.

  python benchmarks/driver_bytes.py [--steps 3] [key=value ...]

Runs a recipe (default: the main job, grpo_tiny_cpu, without its warm start) and counts, inside
each trainer step, the serialized size of what the driver sends (arguments of actor calls,
ray.put) and receives (ray.get results), grouped by actor method. Weight bytes of a refit never
pass through the driver and are not counted (the object-store refit forwards references).
"""

import argparse
import json
import sys
from collections import Counter

import ray
from ray import cloudpickle
from ray.actor import ActorMethod


class DriverBytes:
    def __init__(self):
        self.sent, self.received, self.seen = Counter(), Counter(), set()
        self.method_of = {}  # object ref -> the actor method that made it
        self.counting = False

    def size(self, obj) -> int:
        return len(cloudpickle.dumps(obj))

    def install(self):
        original_remote, original_put, original_get = ActorMethod._remote, ray.put, ray.get
        meter = self

        def remote(method, args=None, kwargs=None, **options):
            refs = original_remote(method, args, kwargs, **options)
            if meter.counting:
                inline = [a for a in [*(args or ()), *(kwargs or {}).values()] if not isinstance(a, ray.ObjectRef)]
                meter.sent[method._method_name] += meter.size(inline) if inline else 0
                for ref in refs if isinstance(refs, list) else [refs]:
                    meter.method_of[ref] = method._method_name
            return refs

        def put(value, *args, **kwargs):
            if meter.counting:
                meter.sent["ray.put"] += meter.size(value)
            return original_put(value, *args, **kwargs)

        def get(refs, *args, **kwargs):
            values = original_get(refs, *args, **kwargs)
            if meter.counting:
                pairs = zip(refs, values) if isinstance(refs, list) else [(refs, values)]
                for ref, value in pairs:
                    if isinstance(ref, ray.ObjectRef) and ref not in meter.seen:
                        meter.seen.add(ref)
                        meter.received[meter.method_of.get(ref, "other")] += meter.size(value)
            return values

        ActorMethod._remote, ray.put, ray.get = remote, put, get


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="grpo_tiny_cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    try:  # this layout, or the one before rlkit/launch existed (to measure the code this replaced)
        from rlkit.launch.config import load_config
        from rlkit.launch.run import train
    except ImportError:
        from rlkit.algorithms import run as train
        from rlkit.config.load import load_config
    from rlkit.algorithms.policy_gradient import PolicyGradientTrainer

    meter = DriverBytes()
    meter.install()
    per_step = []
    step = PolicyGradientTrainer.step

    def counted_step(self, rows, index):
        meter.sent.clear(), meter.received.clear()
        meter.counting = True
        try:
            return step(self, rows, index)
        finally:
            meter.counting = False
            per_step.append({"sent": dict(meter.sent), "received": dict(meter.received)})

    PolicyGradientTrainer.step = counted_step
    cfg, resolved = load_config(args.recipe, ["algorithm.warm_start.sft_steps=0", f"algorithm.num_steps={args.steps}",
                                              "algorithm.val_every=1000", "checkpoint.every=0", "checkpoint.resume=none",
                                              "run.name=driver_bytes", *args.overrides])
    train(cfg, resolved)
    last = per_step[-1]
    total = sum(last["sent"].values()) + sum(last["received"].values())
    report = {"recipe": args.recipe, "bytes_per_step": total, "sent": last["sent"], "received": last["received"]}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
