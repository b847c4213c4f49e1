"""verl's side of the e2e benchmark on CPU (benchmarks/e2e_verl.py): its console step lines parsed
into phases, its reward, the prompts and parquet it is given, and one run_verl through a stand-in
`verl.trainer.main_ppo` that prints what verl prints."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import e2e_verl  # noqa: E402
from verl_reward import compute_score, final_answer  # noqa: E402

from rlkit.config.schema import PromptDataConfig  # noqa: E402
from rlkit.data.files import write_jsonl  # noqa: E402
from rlkit.models.tiny import build_tokenizer  # noqa: E402

# verl 0.9.1's own concat_dict_to_str (verl/utils/logger/aggregate_logger.py) applied to metrics named
# as verl names them (timing_s/* from marked_timer in trainer/ppo/v1/trainer_base.py and trainer_sync.py,
# perf/* from metric_utils.compute_throughout_metrics, training/* from PPOTrainer._compute_metrics),
# numpy scalars included, then forwarded by Ray from the TaskRunnerV1 actor (colored prefix)
VERL_LINE = (
    "step:3 - actor/pg_loss:-0.0123 - actor/pg_clipfrac:0.0021 - actor/ppo_kl:1.2e-05 - actor/grad_norm:0.84 - "
    "actor/lr:1e-05 - perf/mfu/actor:0.031 - actor/perf/max_memory_allocated_gb:6.42 - training/global_step:3 - "
    "training/epoch:0 - critic/score/mean:0.0625 - critic/advantages/mean:0.0 - response_length/mean:128.0 - "
    "response_length/clip_ratio:1.0 - prompt_length/mean:79.4 - num_turns/mean:np.float64(2.0) - "
    "num_turns/min:np.int32(2) - timing_s/gen:6.0412 - timing_s/old_log_prob:1.9873 - timing_s/adv:0.0311 - "
    "timing_s/update_actor:4.5121 - timing_s/update_weights:0.1702 - timing_s/step:13.1042 - "
    "timing_per_token_ms/gen:0.0922 - timing_per_token_ms/update_actor:0.0427 - perf/total_num_tokens:106189 - "
    "perf/time_per_step:13.1042 - perf/throughput:8103.3 - training/num_turns/mean:np.float64(2.0) - "
    "training/off_policy/trajectory_staleness/mean:np.float64(0.0) - "
    "training/off_policy/trajectory_spans/max:np.int64(1)")
RAY_PREFIX = "\x1b[36m(TaskRunnerV1 pid=4242)\x1b[0m "
ROWS = [{"question": "Ana has 3 apples. Ana gets 4 more. How many apples does Ana have now?",
         "answer": "3 + 4 = <<3+4=7>>7\nAna has 7 apples now.\n#### 7"},
        {"question": "Tom has 9 books. Tom gives 2 away. How many books does Tom have now?",
         "answer": "9 - 2 = <<9-2=7>>7\nTom has 7 books now.\n#### 7"}]


def test_step_line_forwarded_by_ray_parses_to_numbers():
    step, metrics = e2e_verl.parse_step_line(RAY_PREFIX + VERL_LINE + "\n")
    assert step == 3 and len(metrics) == 30
    assert metrics["timing_s/gen"] == 6.0412 and metrics["actor/ppo_kl"] == 1.2e-05
    assert metrics["num_turns/min"] == 2.0 and metrics["training/off_policy/trajectory_spans/max"] == 1.0
    assert metrics["perf/total_num_tokens"] == 106189 and metrics["actor/pg_loss"] == -0.0123


@pytest.mark.parametrize("line", ["Training Progress:  40%|####      | 2/5 [00:31<00:46, 15.6s/it]",
                                  "(TaskRunnerV1 pid=1) training/global_step:3 - x:1", "step:3 without metrics",
                                  "ray init kwargs: {'num_cpus': None}"])
def test_other_lines_are_not_steps(line):
    assert e2e_verl.parse_step_line(line) is None


def test_phases_of_a_step():
    phases = e2e_verl.step_phases(e2e_verl.parse_step_line(VERL_LINE)[1])
    assert phases == pytest.approx({"generate": 6.0412, "logprobs": 1.9873, "train": 4.5121, "weight_sync": 0.1702,
                                    "step": 13.1042, "other": 13.1042 - 6.0412 - 1.9873 - 4.5121 - 0.1702})


def test_reference_logprobs_count_as_logprobs():
    metrics = {**e2e_verl.parse_step_line(VERL_LINE)[1], "timing_s/ref": 1.5}
    assert e2e_verl.step_phases(metrics)["logprobs"] == pytest.approx(1.9873 + 1.5)


def test_a_missing_timer_is_named():
    metrics = {k: v for k, v in e2e_verl.parse_step_line(VERL_LINE)[1].items() if k != "timing_s/update_weights"}
    with pytest.raises(ValueError, match="timing_s/update_weights"):
        e2e_verl.step_phases(metrics)


def test_verls_throughput_mfu_and_memory_under_rlkits_names():
    figures = e2e_verl.step_figures(e2e_verl.parse_step_line(VERL_LINE)[1])
    assert figures == {"tokens_per_s_per_gpu": 8103.3, "timing/train_mfu": 0.031, "memory/policy_peak_gb": 6.42}


def test_median_skips_the_warm_up_step():
    steps = [{"phases": {"step": s, "generate": s / 2}} for s in (90.0, 10.0, 14.0, 12.0)]
    assert e2e_verl.median_phases(steps) == {"step": 12.0, "generate": 6.0}


@pytest.mark.parametrize("response, score", [("3 + 4 = 7\n#### 7", 1.0), ("#### 7.0 apples", 1.0),
                                             ("She has 7 apples.", 1.0), ("#### 8, not 7", 0.0),
                                             ("no idea", 0.0), ("#### \nso 1,007", 0.0)])
def test_reward_reads_the_final_number(response, score):
    assert compute_score("rlkit_word_problems", response, "7.0") == score


def test_final_answer_takes_the_hashes_first():
    assert final_answer("12 then 13\n#### 1,000 total") == 1000.0
    assert final_answer("no hashes: 4 then -5") == -5.0 and final_answer("####") is None


def workload(**changes) -> e2e_verl.Workload:
    base = dict(prompts_per_step=64, group_size=8, response_tokens=128, max_prompt_tokens=96, micro_batch_per_gpu=32,
                train_global_batch=256, lr=1e-5, steps=3, gpu_memory_utilization=0.3, enforce_eager=True, kl_coef=0.0)
    return e2e_verl.Workload(**{**base, **changes})


def test_overrides_carry_the_workload(tmp_path):
    overrides = e2e_verl.verl_overrides(workload(), tmp_path / "m", tmp_path / "d", tmp_path, e2e_verl.VerlSetup(),
                                        poll_interval_s=None)
    args = dict(arg.split("=", 1) for arg in overrides)
    assert args["actor_rollout_ref.actor.ppo_mini_batch_size"] == "32"  # prompts: 256 samples / 8
    assert args["actor_rollout_ref.rollout.ignore_eos"] == "true" and args["data.max_response_length"] == "128"
    assert args["actor_rollout_ref.rollout.max_model_len"] == "224" and args["actor_rollout_ref.rollout.n"] == "8"
    assert args["actor_rollout_ref.actor.use_kl_loss"] == "false"
    assert "trainer.v1.sampler.custom_sampler.path" not in args


def test_kl_and_a_shorter_poll(tmp_path):
    overrides = e2e_verl.verl_overrides(workload(kl_coef=0.01), tmp_path, tmp_path, tmp_path, e2e_verl.VerlSetup(),
                                        poll_interval_s=0.1)
    args = dict(arg.split("=", 1) for arg in overrides)
    assert args["actor_rollout_ref.actor.use_kl_loss"] == "true"
    assert args["actor_rollout_ref.actor.kl_loss_coef"] == "0.01"
    assert args["+trainer.v1.sampler.sampler_kwargs.poll_interval_s"] == "0.1"
    assert args["trainer.v1.sampler.custom_sampler.path"].endswith("benchmarks/verl_poll.py")


def verl_args(w: e2e_verl.Workload, setup: e2e_verl.VerlSetup, at: Path) -> dict:
    return dict(arg.split("=", 1) for arg in e2e_verl.verl_overrides(w, at, at, at, setup, None))


def test_tuned_as_verls_guide_says_on_four_gpus(tmp_path):
    w = workload(response_tokens=1024, max_prompt_tokens=256, enforce_eager=False)
    args = verl_args(w, e2e_verl.VerlSetup(gpus=4, rollout_tp=2), tmp_path)
    assert args["trainer.n_gpus_per_node"] == "4"
    assert args["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "2"
    assert args["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert args["actor_rollout_ref.actor.use_dynamic_bsz"] == "true"
    assert args["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "24576"
    # forward-only passes at twice the training limit
    assert args["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] == "49152"
    assert args["actor_rollout_ref.model.enable_gradient_checkpointing"] == "true"
    assert args["actor_rollout_ref.rollout.enforce_eager"] == "false"
    # no flash-attn in verl's install: SDPA, and no packing through an explicit mask
    assert args["actor_rollout_ref.model.use_remove_padding"] == "false"
    assert args["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"


def test_a_token_limit_under_two_sequences_is_raised_to_two(tmp_path):
    args = verl_args(workload(response_tokens=3840, max_prompt_tokens=256),
                     e2e_verl.VerlSetup(max_token_len_per_gpu=1000), tmp_path)
    assert args["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == str(2 * 4096)


def test_with_flash_attn_verl_packs_with_its_own_attention(tmp_path):
    args = verl_args(workload(), e2e_verl.VerlSetup(flash_attn=True), tmp_path)
    assert args["actor_rollout_ref.model.use_remove_padding"] == "true"
    assert "+actor_rollout_ref.model.override_config.attn_implementation" not in args
    (tmp_path / "site" / "flash_attn").mkdir(parents=True)
    assert not e2e_verl.flash_attn_installed(str(tmp_path / "site"))
    (tmp_path / "site" / "flash_attn" / "__init__.py").write_text("")
    assert e2e_verl.flash_attn_installed(str(tmp_path / "site"))


def test_the_megatron_backend_sets_its_parallelism_for_actor_and_reference(tmp_path):
    setup = e2e_verl.VerlSetup(gpus=4, backend="megatron", tp=2)
    overrides = e2e_verl.verl_overrides(workload(), tmp_path, tmp_path, tmp_path, setup, None)
    args = dict(arg.split("=", 1) for arg in overrides)
    assert "model_engine=megatron" in overrides and "actor_rollout_ref.actor.strategy" not in args
    assert args["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == "2"
    assert args["actor_rollout_ref.ref.megatron.tensor_model_parallel_size"] == "2"


@pytest.mark.parametrize("setup, problem", [(dict(backend="deepspeed"), "--backend"),
                                            (dict(gpus=4, rollout_tp=3), "--rollout-tp")])
def test_a_setup_verl_cannot_run_is_named(tmp_path, setup, problem):
    with pytest.raises(ValueError, match=problem):
        e2e_verl.verl_overrides(workload(), tmp_path, tmp_path, tmp_path, e2e_verl.VerlSetup(**setup), None)


def test_a_batch_that_splits_groups_fails_at_setup(tmp_path):
    with pytest.raises(ValueError, match="train_global_batch"):
        e2e_verl.verl_overrides(workload(train_global_batch=100), tmp_path, tmp_path, tmp_path, e2e_verl.VerlSetup(),
                                None)


def test_verl_sees_only_its_own_install():
    env = e2e_verl.verl_env("/tmp/site-verl", {"PYTHONPATH": "/tmp/site:/repo", "RAY_ADDRESS": "127.0.0.1:6379",
                                               "PATH": "/usr/bin", "HOME": "/root"})
    assert env["PYTHONPATH"] == "/tmp/site-verl" and "RAY_ADDRESS" not in env
    assert env["PATH"] == "/tmp/site-verl/bin:/usr/bin" and env["HOME"] == "/root"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    build_tokenizer().save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def prompt_data(**changes) -> PromptDataConfig:
    base = dict(name="prompts", train_path="unused", val_path=None, subset=None, train_split="train", val_split="test",
                val_size=None, prompt_field="question", answer_field="answer", max_prompt_tokens=1024,
                max_row_bytes=1 << 20, chat_template=True, system_prompt="Be brief.",
                prompt_format="{prompt}\nAnswer after ####.", synthetic=None)
    return PromptDataConfig(**{**base, **changes})


def test_parquet_holds_rlkit_prompts(tmp_path, model_dir):
    pd = pytest.importorskip("pandas", reason="writing verl's parquet needs pandas")
    pytest.importorskip("pyarrow", reason="writing verl's parquet needs pyarrow")
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = e2e_verl.rlkit_prompts(tmp_path / "rows.jsonl", prompt_data(), 1024, tokenizer)
    e2e_verl.check_same_prompts(prompts, tokenizer)
    train, val = e2e_verl.write_verl_data(prompts, tmp_path / "data", val_rows=1)
    rows = pd.read_parquet(train).to_dict("records")
    assert len(rows) == 2 and len(pd.read_parquet(val)) == 1
    messages = [dict(m) for m in rows[0]["prompt"]]
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": ROWS[0]["question"] + "\nAnswer after ####."}]
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "7.0"}
    assert rows[1]["extra_info"] == {"index": 1} and rows[1]["data_source"] == "rlkit_word_problems"
    expected = [json.loads(line) for line in (tmp_path / "data" / "expected_ids.jsonl").read_text().splitlines()]
    assert expected == [p.token_ids for p in prompts]
    assert e2e_verl.verl_prompt_ids(tokenizer, messages) == prompts[0].token_ids


def test_prompts_over_the_limit_are_dropped_as_rlkit_drops_them(tmp_path, model_dir):
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], {**ROWS[1], "question": ROWS[1]["question"] * 4}])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limit = len(e2e_verl.rlkit_prompts(tmp_path / "rows.jsonl", prompt_data(), 1024, tokenizer)[0].token_ids)
    assert len(e2e_verl.rlkit_prompts(tmp_path / "rows.jsonl", prompt_data(), limit, tokenizer)) == 1


def test_a_rendering_mismatch_is_an_error(tmp_path, model_dir):
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = e2e_verl.rlkit_prompts(tmp_path / "rows.jsonl", prompt_data(), 1024, tokenizer)[0]
    with pytest.raises(ValueError, match="prompt 0: verl would send"):
        e2e_verl.check_same_prompts([type(prompt)(prompt.messages, prompt.token_ids[1:], prompt.metadata)], tokenizer)


def test_raw_prompts_are_refused(tmp_path, model_dir):
    with pytest.raises(ValueError, match="data.chat_template=false"):
        e2e_verl.rlkit_prompts(tmp_path / "rows.jsonl", prompt_data(chat_template=False), 1024, None)


# a stand-in for verl: prints two step lines as Ray forwards them, after checking it was started right
FAKE_MAIN_PPO = textwrap.dedent("""
    import os, sys
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    assert os.environ["PYTHONPATH"] == {site!r}, os.environ["PYTHONPATH"]
    assert os.path.isfile(args["data.train_files"]) and args["actor_rollout_ref.rollout.ignore_eos"] == "true"
    for step in (1, 2):
        print({line!r}.replace("step:3", f"step:{{step}}"), flush=True)
    sys.exit({code})
""")


def fake_verl(site: Path, code: int = 0) -> str:
    (site / "verl" / "trainer").mkdir(parents=True)
    (site / "verl" / "__init__.py").write_text("")
    (site / "verl" / "trainer" / "__init__.py").write_text("")
    (site / "verl" / "trainer" / "main_ppo.py").write_text(
        FAKE_MAIN_PPO.format(site=str(site), line=RAY_PREFIX + VERL_LINE, code=code))
    return str(site)


def test_run_verl_reports_each_step(tmp_path, model_dir):
    pytest.importorskip("pyarrow", reason="writing verl's parquet needs pyarrow")
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    site = fake_verl(tmp_path / "site")
    result = e2e_verl.run_verl(workload(max_prompt_tokens=1024), model_dir, tmp_path / "work", site, 60,
                               prompts_jsonl=tmp_path / "rows.jsonl", prompt_data=prompt_data(),
                               extra_overrides=["actor_rollout_ref.rollout.max_num_seqs=256"])
    assert (result["returncode"], result["timed_out"]) == (0, False)
    assert result["command"][-1] == "actor_rollout_ref.rollout.max_num_seqs=256"  # last: it wins in Hydra
    assert [s["step"] for s in result["steps"]] == [1, 2] and result["median"]["train"] == pytest.approx(4.5121)
    assert "timing_s/step:13.1042" in Path(result["log"]).read_text()


def test_a_run_with_no_step_shows_the_log(tmp_path, model_dir):
    pytest.importorskip("pyarrow", reason="writing verl's parquet needs pyarrow")
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    site = tmp_path / "site"
    fake_verl(site)
    (site / "verl" / "trainer" / "main_ppo.py").write_text("import sys\nprint('KeyError: no such key')\nsys.exit(1)\n")
    with pytest.raises(RuntimeError, match="(?s)returncode 1.*KeyError: no such key"):
        e2e_verl.run_verl(workload(max_prompt_tokens=1024), model_dir, tmp_path / "work", str(site), 60,
                          prompts_jsonl=tmp_path / "rows.jsonl", prompt_data=prompt_data())


def test_a_run_past_its_limit_is_stopped(tmp_path):
    log = tmp_path / "log"
    code = f"print({VERL_LINE!r}, flush=True); import time; time.sleep(60)"
    returncode, timed_out, seen = e2e_verl._run_logged([sys.executable, "-c", code], {"PATH": "/usr/bin"}, tmp_path,
                                                       log, timeout_s=3)
    assert timed_out and returncode != 0 and [step for _, step, _ in seen] == [3]


def test_processes_left_behind_by_the_run_are_stopped(tmp_path):
    log = tmp_path / "log"
    code = "import subprocess; print(subprocess.Popen(['sleep', '60']).pid, flush=True)"
    returncode, timed_out, _ = e2e_verl._run_logged([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, tmp_path,
                                                    log, timeout_s=30)
    assert (returncode, timed_out) == (0, False)
    stat = Path(f"/proc/{int(log.read_text())}/stat")
    assert not stat.exists() or stat.read_text().split()[2] in "ZX"  # gone, or a zombie its new parent has not reaped
