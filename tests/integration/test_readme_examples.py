"""The README's CPU `rlkit train` commands pasted in order, the quick start first, into one fresh
output folder: each trains a run of its own (the TP=2 one on 2 CPU ranks, the custom environment
with its my_env.py beside it), where a later one used to end at once on the quick start's finished
run, its settings unused. Without its run.name, the TP=2 command is refused in one line, before
Ray or a worker is asked for anything. Each runs 2 steps without a warm start or validation, in
this process on the session's cluster and workers (the command line's own start-up is test_cli's)."""

import pytest
from readme_commands import README, env_example, train_commands

from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config
from rlkit.launch.run import train

pytestmark = pytest.mark.integration

SHORT = ["algorithm.num_steps=2", "algorithm.prompts_per_step=8", "policy.train_global_batch_size=64",
         "algorithm.warm_start.sft_steps=0", "data.val_path=null", "logger.plots=false", "logger.tensorboard=false"]


def test_the_readme_commands_in_order_each_train_a_run_of_their_own(warm_pool, cache_dir, tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(env_example()[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the environment workers import it too
    here = [*SHORT, f"run.cache_dir={cache_dir}", f"run.output_dir={tmp_path / 'outputs'}"]
    commands = [c for c in train_commands(README) if c.trains_on_cpu()]
    assert commands[0].overrides == [] and len(commands) >= 3, commands  # the quick start first
    trained = {}
    for command in commands:
        result = train(*load_config(command.recipe, [*command.overrides, *here]), pool=warm_pool)
        assert result.run_dir not in trained, f"{command} ended on the run of {trained.get(result.run_dir)}"
        assert [m["step"] for m in result.history] == [1, 2] and "train/loss" in result.history[-1], command
        trained[result.run_dir] = command
    tp2 = next(c for c in commands if "policy.tensor_parallel_size=2" in c.overrides)
    unnamed = [word for word in tp2.overrides if not word.startswith("run.name=")]
    with pytest.raises(ConfigError, match=r"^run\.name=grpo_tiny_cpu: .* \(step 2, the run has finished\) was saved "
                                          r"with other settings: policy\.tensor_parallel_size: 1 -> 2, "
                                          r"algorithm\.kl_coef: 0\.0 -> 0\.01; set another run\.name"):
        train(*load_config(tp2.recipe, [*unnamed, *here]), pool=warm_pool)
