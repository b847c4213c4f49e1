#!/usr/bin/env bash
# rlkit's GPU work on a GPU machine whose missing wheels were staged and installed (docs/gpu.md).
#   bash scripts/gpu_session.sh tests|tests-of <s> <pytest args>|refit-tests|bench|bench-7b|refit-bench|refit-bench-512|all    logs and JSON land in $OUT
#   bash scripts/gpu_session.sh smollm2-gap|smollm2-train    SmolLM2: train-vs-generation gap (layer by layer, and the recipe's), GRPO run
#   bash scripts/gpu_session.sh bridge-run <s> <mbridge|megatron_bridge> [overrides]    the SmolLM2 recipe on one bridge
#   bash scripts/gpu_session.sh smollm2-run <s> <label> [overrides]    the SmolLM2 recipe, its log and metrics labelled
#   bash scripts/gpu_session.sh lora-run <s> <merged|adapter> [overrides]    the same with LoRA rank 16 on every linear layer; refit.peft as named
#   bash scripts/gpu_session.sh e2e <s> <model> [e2e.py args] | train-mfu <s> <label> [train_mfu.py args]    end-to-end and training-throughput benchmarks
#   TE=1 bash scripts/gpu_session.sh ...    with TransformerEngine from /tmp/site-te (scripts/build_te.sh builds its extension)
#     (e2e <s> smollm2 --trl: TRL's GRPOTrainer on the same workload after rlkit; trl in the wheel list: EXTRA_WHEELS)
#   bash scripts/gpu_session.sh startup-run <s> <label> [overrides]    SmolLM2 recipe, 9 steps: start-up phases, checkpoints every 3
#   bash scripts/gpu_session.sh recipe-run <s> <recipe> [overrides]    a SmolLM2 recipe as shipped (tools vs none: grpo_smollm2_gpu_tools, grpo_smollm2_gpu)
#   bash scripts/gpu_session.sh rm-run <s> [overrides]    SmolLM2 reward model (reward_model_smollm2_gpu), its export, then grpo_smollm2_gpu_reward_model
#   bash scripts/gpu_session.sh delta-run <s> <steps> [overrides]    SmolLM2 recipe with HF checkpoints every step, then the
#     delta sparsity of each step's weights against the step before (benchmarks/delta_sparsity.py --checkpoints)
#   bash scripts/gpu_session.sh e2e-verl [seconds] [e2e_verl.py args]    verl 0.9.1 on SmolLM2 from /tmp/site-verl (scripts/verl_stack.sh)
#   bash scripts/gpu_session.sh refit-layouts <s> <size> <layout,...>    refit benchmark on layouts of several GPUs
#   bash scripts/gpu_session.sh tests-start <until epoch> [gpu_tests.py args]; tests-wait <s>    tests/gpu over every GPU,
#     several groups at once (scripts/gpu_tests.py), in its own session: it runs on between calls; each wait brings its logs
#   bash scripts/gpu_session.sh async <s> <k,...> [async_grpo.py args]    async GRPO: SmolLM2, disaggregated on 2 GPUs, per
#     max_staleness (one per call: async 590 0 --timeout 570, then async 590 1 --timeout 570; results merge in /tmp/async_grpo.json)
#   bash scripts/gpu_session.sh e2e-queue <label>...; e2e-wait <s>    named end-to-end runs of 4 GPUs (named_run below: 7B
#     layouts, verl on the 7B, NeMo-RL's Llama-8B workload, MoE), one after the other in a session of their own that runs on
#     between calls; each e2e-wait (calls back to back, < 30 s apart) waits until a run ends or s seconds pass and brings what has finished
set -uo pipefail
source /tmp/gpucarry/env.sh
[ "${TE:-0}" = 1 ] && export PYTHONPATH=/tmp/site-te:${PYTHONPATH:-}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RLKIT_TEST_METRICS=${OUT:-/tmp/rlkit_out}/metrics
OUT=${OUT:-/tmp/rlkit_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
tests() { timeout "$1" python3 -m pytest ${2:-tests/gpu} -v -rA -s -p no:cacheprovider --timeout=200 2>&1 | tee -a "$OUT/gpu_tests.log"; }
generation() { timeout 250 python3 benchmarks/generation.py --size 1.5b --out "$OUT/generation.json" 2>&1 | tee "$OUT/generation.log"; }
refit() { timeout "$2" python3 benchmarks/refit.py --sizes "$1" --bucket-mb "${3:-512,2048}" --out "$OUT/refit_${1//,/-}.json" 2>&1 | tee "$OUT/refit_${1//,/-}.log"; }
smollm2() { python3 -m rlkit.cli pretrained smollm2-135m-instruct 2>&1 | tail -1 | tee "$OUT/smollm2_path.txt"; }
gap() {  # layer by layer (benchmarks/logprob_gap.py), then the recipe's refit: its prompts sampled by vLLM, scored by the policy
  timeout 270 python3 benchmarks/logprob_gap.py --out "$OUT/logprob_gap.json" 2>&1 | tee "$OUT/logprob_gap.log" \
    | grep "^T=\|^layers\|Error"
  timeout 150 python3 -m rlkit.cli verify-refit --config-name grpo_smollm2_gpu --num-prompts 128 2>&1 \
    | tee "$OUT/verify_refit.log" | grep "^refit/\|^timing/"
}
train_smollm2() {  # resumes from its last checkpoint when a call before was cut short
  timeout "$1" python3 -m rlkit.cli train --config-name grpo_smollm2_gpu "${@:2}" 2>&1 | tee -a "$OUT/smollm2_train.log" | grep -v "^(\|Warn"
  cp -r outputs/grpo_smollm2_gpu/metrics.jsonl outputs/grpo_smollm2_gpu/plots "$OUT/" 2>/dev/null
}
e2e_verl() {  # the driver runs in rlkit's environment; verl in a subprocess on its own install only
  timeout "$1" python3 benchmarks/e2e_verl.py --model "$(cat "$OUT/smollm2_path.txt")" --site /tmp/site-verl \
    --work /tmp/e2e_verl --out "$OUT/e2e_verl.json" --timeout $(( $1 - 30 )) "${@:2}" 2>&1 | tee "$OUT/e2e_verl.log" | tail -3
  cp /tmp/e2e_verl/verl.log "$OUT/verl_run.log" 2>/dev/null
  cp "$OUT/e2e_verl.json" /tmp/e2e_verl.json 2>/dev/null  # for a later call's `e2e ... --compare /tmp/e2e_verl.json`
}
E2E=/tmp/e2e  # e2e-queue's runs: a folder each (result.json, logs), models in cache/, queue.txt says what ended how
named_run() {  # named_run <label>: one run of the 4-GPU plan, its result and logs in $E2E/<label>
  local dir=$E2E/$1
  # the LM head in bf16 (with fp32 logits), as verl's is: rlkit's fp32 head halved the 1.7B shape's training MFU
  local rlkit="python3 benchmarks/e2e.py --work-dir $dir --cache-dir $E2E/cache --out $dir/result.json --timeout 900
               --rlkit-overrides policy.fp32_lm_head=false"
  # Qwen2.5-7B's shape, 64 prompts x 8 samples of exactly 256 + 1024 tokens, 2 optimizer steps a rollout
  local qwen7b="--model qwen2.5-7b --max-prompt-tokens 256 --response-tokens 1024 --micro-batch-per-gpu 4 --steps 4"
  # NeMo-RL's Llama-3.1-8B GRPO (grpo-llama3.1-8b-instruct-1n8g): 64 x 32 samples of up to 4096 tokens, global batch
  # 512; a step of 4096 tokens is about 10 minutes on 4 GPUs by estimate: a lease holds start-up and two steps,
  # stopped (steps reported) before the machine goes back; the 2048-token variant holds three
  local nemo8b="--model llama3.1-8b --prompts-per-step 64 --group-size 32 --max-prompt-tokens 256
                --train-global-batch 512 --micro-batch-per-gpu 1"
  local nemo4k="$nemo8b --response-tokens 3840 --steps 3 --timeout 1380" nemo2k="$nemo8b --response-tokens 1792 --steps 4"
  local moe="--model qwen3-moe-16b-a3b --ep 4 --max-prompt-tokens 256 --response-tokens 1024 --micro-batch-per-gpu 4 --steps 4"
  case "$1" in
    7b-colocated) $rlkit $qwen7b --layout colocated ;;  # DP=4, an engine on each GPU
    7b-fsdp2) $rlkit $qwen7b --layout colocated --rlkit-overrides policy=fsdp2_gpu policy.fp32_lm_head=false ;;  # FSDP2 over 4 ranks, an engine on each GPU
    7b-colocated-tp2) $rlkit $qwen7b --layout colocated --tp 2 --engine-tp 2 ;;  # TP=2 x DP=2, two engines of 2 GPUs
    7b-disaggregated) $rlkit $qwen7b --layout disaggregated --policy-gpus 2 --gpu-memory-utilization 0.85 ;;
    7b-async) $rlkit $qwen7b --layout async --policy-gpus 2 --staleness 1 --gpu-memory-utilization 0.85 ;;
    verl-7b) python3 benchmarks/e2e_verl.py --model qwen2.5-7b --cache-dir $E2E/cache --site /tmp/site-verl --work "$dir" \
               --out "$dir/result.json" --timeout 1200 --max-prompt-tokens 256 --response-tokens 1024 --steps 4 \
               --poll-interval 0.2 ;;  # FSDP2, 4 vLLM engines of 1 GPU, verl's tuning (e2e_verl.VerlSetup)
    nemo-8b) $rlkit $nemo4k --layout colocated --gpu-memory-utilization 0.7 ;;
    nemo-8b-async) $rlkit $nemo4k --layout async --policy-gpus 2 --staleness 1 --gpu-memory-utilization 0.85 ;;
    nemo-8b-2k) $rlkit $nemo2k --layout colocated --gpu-memory-utilization 0.7 ;;
    nemo-8b-2k-async) $rlkit $nemo2k --layout async --policy-gpus 2 --staleness 1 --gpu-memory-utilization 0.85 ;;
    moe) $rlkit $moe --layout colocated ;;  # Qwen3-30B-A3B with 64 experts, EP=4
    moe-30b) $rlkit ${moe/qwen3-moe-16b-a3b/qwen3-30b-a3b} --layout colocated ;;  # refused by the memory estimate at once
    *) echo "named_run: no run named $1"; return 2 ;;
  esac
}
e2e_queue() {  # the named runs one after the other; what each ended with in $E2E/queue.txt
  mkdir -p "$E2E"
  for label in "$@"; do
    named_run "$label" > "$E2E/$label.log" 2>&1
    echo "$label rc=$? at $(date +%T): $(tail -1 "$E2E/$label.log" | cut -c1-300)" >> "$E2E/queue.txt"
  done
  echo "queue done at $(date +%T)" >> "$E2E/queue.txt"
}
e2e_wait() {  # until a run of the queue ends or $1 seconds pass; then its state and every finished run's files into $OUT
  # (the queue's lines, not its process id: a later call may run in another process namespace)
  local waited=0 lines; touch "$E2E/queue.txt"; lines=$(wc -l < "$E2E/queue.txt")
  while [ "$(wc -l < "$E2E/queue.txt")" -eq "$lines" ] && ! grep -q "^queue done" "$E2E/queue.txt" && [ $waited -lt "$1" ]; do
    sleep 5; waited=$((waited + 5)); done
  cp "$E2E/queue.txt" "$OUT/e2e_queue.txt" 2>/dev/null; cat "$E2E/queue.txt" 2>/dev/null
  tar -czf "$OUT/e2e_runs.tar.gz" -C "$E2E" --exclude=cache --exclude=prompts --exclude=data --exclude='prompts*.jsonl' \
    --exclude=checkpoints --exclude=plots --exclude=tensorboard . 2>/dev/null
  local latest; latest=$(ls -t $E2E/*/rlkit.log $E2E/*/verl.log 2>/dev/null | head -1)
  grep -q "^queue done" "$E2E/queue.txt" || { echo "e2e: still running: $latest"; tail -3 "$latest" | cut -c1-300; }
}
LORA16="policy.peft={type:lora,rank:16,alpha:32,dropout:0.0,target_modules:[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]}"
bridge_run() {  # bridge_run <s> <label> <bridge> [overrides]: the SmolLM2 recipe, no checkpoints; metrics and log in $OUT
  timeout "$1" python3 -m rlkit.cli train --config-name grpo_smollm2_gpu policy.bridge="$3" run.name="smollm2_$2" \
    checkpoint.every=0 "${@:4}" > "$OUT/smollm2_$2.log" 2>&1
  tail -3 "$OUT/smollm2_$2.log"
  cp "outputs/smollm2_$2/metrics.jsonl" "$OUT/metrics_$2.jsonl" 2>/dev/null
}
startup_run() {  # startup_run <s> <label> [overrides]: the SmolLM2 recipe, 9 steps, a checkpoint every 3 (in the background)
  timeout "$1" python3 -m rlkit.cli train --config-name grpo_smollm2_gpu run.name="startup_$2" algorithm.num_steps=9 \
    algorithm.val_every=100 checkpoint.every=3 "${@:3}" > "$OUT/startup_$2.log" 2>&1
  grep "start-up\|checkpoint step_" "$OUT/startup_$2.log" | tail -8
  cp "outputs/startup_$2/metrics.jsonl" "$OUT/metrics_startup_$2.jsonl" 2>/dev/null
}
recipe_run() {  # recipe_run <s> <recipe> [overrides]: a SmolLM2 recipe as shipped, no checkpoints; metrics and log in $OUT
  timeout "$1" python3 -m rlkit.cli train --config-name "$2" checkpoint.every=0 "${@:3}" > "$OUT/$2.log" 2>&1
  grep "before training\|done:" "$OUT/$2.log" | tail -3
  cp "outputs/$2/metrics.jsonl" "$OUT/metrics_$2.jsonl" 2>/dev/null
}
rm_run() {  # rm_run <s> [overrides]: SmolLM2's reward model, its HF export, then GRPO on the rule and it; logs in $OUT
  local rm=outputs/reward_model_smollm2_gpu start=$SECONDS
  timeout "$1" python3 -m rlkit.cli train --config-name reward_model_smollm2_gpu > "$OUT/reward_model_smollm2_gpu.log" 2>&1
  grep "before training\|done:" "$OUT/reward_model_smollm2_gpu.log" | tail -2
  cp "$rm/metrics.jsonl" "$OUT/metrics_reward_model_smollm2_gpu.jsonl" 2>/dev/null
  rm -rf "$rm/hf"  # this mode's export from an earlier call: the GRPO run reads the one made now
  python3 -m rlkit.cli convert "$rm/checkpoints/step_000100" "$rm/hf" > "$OUT/reward_model_convert.log" 2>&1
  tail -1 "$OUT/reward_model_convert.log"
  recipe_run $(( $1 - (SECONDS - start) )) grpo_smollm2_gpu_reward_model "${@:2}"
}
delta_run() {  # delta_run <s> <steps> [overrides]: what refit.delta would send after each GRPO step of the SmolLM2 recipe
  timeout "$1" python3 -m rlkit.cli train --config-name grpo_smollm2_gpu run.name=delta algorithm.num_steps="$2" \
    algorithm.val_every=100 checkpoint.save_format=hf checkpoint.every=1 checkpoint.keep_last=0 "${@:3}" > "$OUT/delta_run.log" 2>&1
  tail -2 "$OUT/delta_run.log"
  cp outputs/delta/metrics.jsonl "$OUT/metrics_delta_run.jsonl" 2>/dev/null
  python3 benchmarks/delta_sparsity.py --checkpoints outputs/delta/checkpoints --out "$OUT/delta_smollm2_grpo.json" \
    > "$OUT/delta_sparsity.log" 2>&1
  tail -3 "$OUT/delta_sparsity.log"
}
case "$1" in
  startup-run) smollm2; startup_run "$2" "$3" "${@:4}" ;;
  recipe-run) smollm2; recipe_run "$2" "$3" "${@:4}" ;;  # recipe-run <s> <recipe> [overrides]: e.g. grpo_smollm2_gpu_tools  # startup-run <s> <label> [overrides]: start-up phases, background checkpoints
  bridge-run) smollm2; bridge_run "$2" "$3" "$3" "${@:4}" ;;  # bridge-run <s> <mbridge|megatron_bridge> [overrides]
  smollm2-run) smollm2; bridge_run "$2" "$3" mbridge "${@:4}" ;;  # smollm2-run <s> <label> [overrides]: the recipe on mbridge, labelled
  lora-run) smollm2; bridge_run "$2" "lora_$3" megatron_bridge "$LORA16" "refit.peft=$3" "${@:4}" ;;  # lora-run <s> <merged|adapter> [overrides]
  smollm2-gap) smollm2; gap ;;
  smollm2-train) smollm2; train_smollm2 "${2:-560}" "${@:3}" ;;
  delta-run) smollm2; delta_run "$2" "$3" "${@:4}" ;;
  rm-run) smollm2; rm_run "$2" "${@:3}" ;;  # rm-run <s> [overrides of the GRPO recipe]
  e2e-verl) smollm2; e2e_verl "${2:-480}" "${@:3}" ;;
  async) smollm2; timeout "$2" python3 benchmarks/async_grpo.py --staleness "$3" --out /tmp/async_grpo.json "${@:4}" \
           2>&1 | tee -a "$OUT/async_grpo.log" | tail -4; cp /tmp/async_grpo.json "$OUT/" 2>/dev/null ;;  # 2 GPUs; async <s> <k,...>
  e2e-queue) mkdir -p $E2E; rm -f $E2E/queue.txt; setsid bash "$0" e2e-run-queue "${@:2}" > $E2E/queue.log 2>&1 < /dev/null &
             echo $! > $E2E/queue.pid; echo "e2e: queued ${*:2}" ;;  # e2e-queue <label>...: named_run labels
  e2e-run-queue) e2e_queue "${@:2}" ;;
  e2e-wait) e2e_wait "$2" ;;  # e2e-wait <s>
  tests) tests 560 ;;
  tests-start) mkdir -p /tmp/gpu_tests  # planned with the durations measured last (4x H200) unless --estimates says otherwise
               setsid python3 scripts/gpu_tests.py --log-dir /tmp/gpu_tests --until "$2" \
                 --estimates benchmarks/results/gpu_tests_h200x4/durations.json "${@:3}" \
                 > /tmp/gpu_tests/scheduler.log 2>&1 < /dev/null & echo $! > /tmp/gpu_tests/scheduler.pid ;;  # tests-start <until epoch> [gpu_tests.py args]
  tests-wait) waited=0  # tests-wait <s>: until tests-start's scheduler ends or s seconds pass; its logs in $OUT
              while kill -0 "$(cat /tmp/gpu_tests/scheduler.pid)" 2>/dev/null && [ $waited -lt "$2" ]; do sleep 5; waited=$((waited + 5)); done
              cp /tmp/gpu_tests/scheduler.log /tmp/gpu_tests/durations.json "$OUT/" 2>/dev/null
              tar -czf "$OUT/gpu_tests_logs.tar.gz" -C /tmp/gpu_tests --exclude=tmp . ; grep "gpu_tests\]\|GPU(s):" /tmp/gpu_tests/scheduler.log | tail -12 ;;
  tests-of) tests "$2" "${*:3}" ;;  # tests-of <seconds> <pytest arguments...>
  e2e) timeout "$2" python3 benchmarks/e2e.py --out "$OUT/e2e_$3.json" --model "${@:3}" 2>&1 | grep -v "^(\|Warn" \
         | tee "$OUT/e2e_$3.log"; cp /tmp/rlkit_e2e/rlkit.log "$OUT/e2e_$3_rlkit.log" 2>/dev/null ;;  # e2e <s> <model> [args]
  generation-of) timeout "$2" python3 benchmarks/generation.py --out "$OUT/generation_$3.json" "${@:4}" > "$OUT/generation_$3.log" 2>&1
    tail -2 "$OUT/generation_$3.log" ;;  # generation-of <s> <label> [generation.py args]: rlkit's engine against vLLM's LLM.generate
  train-mfu) timeout "$2" python3 benchmarks/train_mfu.py --out "$OUT/train_mfu_$3.json" "${@:4}" > "$OUT/train_mfu_$3.log" 2>&1
             grep "^train_mfu\|Error" "$OUT/train_mfu_$3.log" | tail -3 ;;  # train-mfu <s> <label> [train_mfu.py args]
  refit-tests) tests 560 tests/gpu/test_vllm_refit.py ;;
  bench) generation; refit 1.5b 320 ;;
  refit-bench) refit 1.5b,7b 570 ;;
  refit-bench-512) refit 1.5b,7b 400 512 ;;
  bench-7b) refit 7b 570 ;;
  refit-layouts) timeout "$2" python3 benchmarks/refit.py --sizes "$3" --transports "$4" --bucket-mb 512 \
                   --out "$OUT/refit_$3_layouts.json" > "$OUT/refit_$3_layouts.log" 2>&1
                 tail -14 "$OUT/refit_$3_layouts.log" ;;  # refit-layouts <s> <size> <layout,...>: benchmarks/refit.py TRANSPORTS
  all) tests 330; refit 1.5b 240 ;;
esac
