"""Every `rlkit train` command in the README and docs/ does what it says when a reader pastes it after
the ones before it: one that names a run an earlier command made (the same run.name) changes nothing
that run trains, which rlkit would refuse (rlkit/launch/resume_drift.py). The README's CPU commands
also run, in order: tests/integration/test_readme_examples.py."""

from readme_commands import DOCS, README, train_commands

from rlkit.launch.config import compose_recipe
from rlkit.launch.resume_drift import FREE, changes

# what trains: not a printout (--cfg), nor the reader's own recipes (--config-dir)
COMMANDS = [c for page in [README, *DOCS] for c in train_commands(page)
            if c.option("--cfg") is None and c.option("--config-dir") is None]


def test_the_pages_hold_the_commands_this_checks():
    assert sum(c.trains_on_cpu() for c in COMMANDS) >= 5
    assert {"grpo_tiny_gpu", "grpo_tiny_lora_cpu"} <= {c.recipe for c in COMMANDS}


def test_a_command_naming_an_earlier_run_changes_nothing_it_trains():
    unique = {c.args: c for c in COMMANDS}  # a command repeated on another page is the same run
    configs = {args: compose_recipe(c.recipe, c.overrides) for args, c in unique.items()}
    refused = []
    for later, command in enumerate(COMMANDS):
        config = configs[command.args]
        for earlier in COMMANDS[:later]:
            if configs[earlier.args].run.name == config.run.name:
                drift = [str(c) for c in changes(configs[earlier.args], config) if c.kind != FREE]
                refused += [f"{command} after {earlier}: rlkit refuses {drift}"] if drift else []
    assert not refused, "give each its own run.name:\n" + "\n".join(refused)
