#!/usr/bin/env bash
# Baseline: MaxText's post-training steps for the tiny local model, run by a plain shell script.
#
#   bench/plain_pipeline.sh [--sft-only] [--resume-check] [WORK_DIR]      (WORK_DIR default: .local/bench-plain)
#
# convert (HF -> MaxText) -> SFT -> export to HF;  convert -> RL (GRPO) -> export to HF; then, if the
# torch venv exists, checks that the exports load in transformers and generate. Prints each step's
# wall time and peak RSS plus its key log lines; full logs go to WORK_DIR/logs. Each run starts from
# a clean WORK_DIR.
#
# The commands are those of the local DAGs posttrain_sft__tiny-llama and posttrain_rl__tiny-llama with the
# quality gate off (tests/test_bench.py compares them), on the same files: the tiny model and its datasets in
# .local/tiny, which the local stack serves on its Hub (local/tiny-llama, local/tiny-chats in UltraChat's
# layout, local/tiny-gsm8k in GSM8K's) and a run's VM copies. Only the places differ: local directories here,
# the VM's copies and checkpoint storage there. The tiny model and data are built there if missing
# (scripts/bootstrap.sh builds them; building is idempotent), and every file a step reads is checked before the
# clock starts.
#
# --sft-only stops after the SFT chain (the baseline of the SFT DAG's wall time, bench/perf.py's P4).
#
# --resume-check also runs SFT with steps=6 (checkpoint_period=2), SIGKILLs it once it logs step 3, and
# re-runs the same command, which resumes from the newest complete checkpoint.
#
# Venvs: $TPU_POSTTRAIN_MAXTEXT_VENV (default .local/maxtext-venv) and $TPU_POSTTRAIN_HFCHECK_VENV
# (default .local/hfcheck-venv); scripts/bootstrap.sh creates both.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
resume_check=false
sft_only=false
while [[ "${1:-}" == --* ]]; do
  case $1 in
    --resume-check) resume_check=true ;;
    --sft-only) sft_only=true ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
work=$(realpath -m "${1:-$repo/.local/bench-plain}")
maxtext_python=${TPU_POSTTRAIN_MAXTEXT_VENV:-$repo/.local/maxtext-venv}/bin/python
hfcheck_python=${TPU_POSTTRAIN_HFCHECK_VENV:-$repo/.local/hfcheck-venv}/bin/python
local_src=$repo/airflow_tpu_posttrain/local
launchers=$local_src/vm_launchers
logs=$work/logs

export JAX_PLATFORMS=cpu TRANSFORMERS_VERBOSITY=error

# The local stack's tiny models and data (recipes/runtime.LOCAL_MODELS under .local, local/tiny_model.py's layout).
tiny=$repo/.local/tiny
hf_model=$tiny/tiny-llama
chats=$tiny/datasets/tiny-chats                 # local/tiny-chats: UltraChat's layout, split train_sft
gsm8k=$tiny/datasets/tiny-gsm8k                 # local/tiny-gsm8k: GSM8K's layout, main/{train,test}-*.parquet
converted=$work/converted
model_name=llama3.1-8b
dims=(override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2
  base_num_decoder_layers=2 base_mlp_dim=128 head_dim=16 vocab_size=512)
cpu=(hardware=cpu skip_jax_distributed_system=true)
sft_steps=5
rl_batches=2

# elapsed START: seconds since START (an $EPOCHREALTIME value).
elapsed() { awk -v start="$1" -v now="$EPOCHREALTIME" 'BEGIN { printf "%.1f", now - start }'; }

# run_step NAME PATTERN COMMAND...: runs COMMAND with it and its output in $logs/NAME.log, prints its wall
# time and peak RSS and the log lines matching the extended regex PATTERN; exits on failure.
run_step() {
  local name=$1 pattern=$2 start=$EPOCHREALTIME
  shift 2
  printf '%q ' "$@" >"$logs/$name.log"
  printf '\n\n' >>"$logs/$name.log"
  if ! /usr/bin/time -f %M -o "$logs/$name.maxrss_kb" "$@" >>"$logs/$name.log" 2>&1; then
    echo "$name FAILED; last lines of $logs/$name.log:" >&2
    tail -n 30 "$logs/$name.log" >&2
    exit 1
  fi
  printf '%-14s %7s s   peak RSS %5d MiB\n' "$name" "$(elapsed "$start")" \
    $(($(tail -n 1 "$logs/$name.maxrss_kb") / 1024))
  grep -E "$pattern" "$logs/$name.log" | sed -E 's/^([IWE][0-9]{4} [^]]*] |INFO:absl:)//; s/^/    /' || true
}

convert_args=(model_name="$model_name" base_output_directory="$converted" scan_layers=True use_multimodal=False
  "${cpu[@]}" checkpoint_storage_use_zarr3=1 checkpoint_storage_use_ocdbt=1 --lazy_load_tensors=True "${dims[@]}"
  --hf_model_path="$hf_model")
# checkpoint_period: the default (10000) saves only step 1 and the last step, leaving a retry little to resume.
sft_args=(model_name="$model_name" load_parameters_path="$converted/0/items" base_output_directory="$work/sft"
  per_device_batch_size=1 hf_path="$chats" train_split=train_sft "train_data_columns=['messages']" profiler=xplane
  checkpoint_period=2 tokenizer_path="$hf_model" "${dims[@]}" "${cpu[@]}" attention=dot_product max_target_length=128)
rl_args=(model_name="$model_name" load_parameters_path="$converted/0/items" run_name=rl base_output_directory="$work/rl"
  "${dims[@]}" chips_per_vm=1 num_batches="$rl_batches" num_test_batches=2
  rollout_data_parallelism=1 rollout_tensor_parallelism=-1 tokenizer_path="$hf_model"
  hf_train_files="$gsm8k/main/train-*.parquet" hf_eval_files="$gsm8k/main/test-*.parquet"
  max_prefill_predict_length=128 max_target_length=160)  # rl.yml sets MaxText's CPU-safe settings itself
# export_step NAME MAXTEXT_PARAMS_DIR OUT_DIR
export_step() {
  run_step "$1" 'successfully saved in HuggingFace format|NNX-RL checkpoint' \
    "$maxtext_python" "$launchers/to_huggingface_cpu.py" model_name="$model_name" load_parameters_path="$2" \
    base_output_directory="$3" scan_layers=True use_multimodal=False weight_dtype=bfloat16 "${cpu[@]}" \
    "${dims[@]}" --override_model_architecture=true --hf_model_path="$hf_model"
}

sft_pattern='Train step [0-9]+ training loss|Train loop finished|Found [0-9]+ checkpoint steps|Restored'

# Kills an SFT run once it has logged step 3, then re-runs it unchanged.
check_sft_resume() {
  local args=("${sft_args[@]}" run_name=resume steps=6) log=$logs/sft-killed.log pid
  "$maxtext_python" -m maxtext.trainers.post_train.sft.train_sft "${args[@]}" >"$log" 2>&1 &
  pid=$!
  tail --pid="$pid" -n +1 -F "$log" 2>/dev/null | grep -m 1 -q 'completed step: 3' || true
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  echo "sft-killed: SIGKILLed after logging step 3; checkpoint dirs:" \
    "$(find "$work/sft/resume/checkpoints" -mindepth 1 -maxdepth 1 -printf '%f ' | tr ' ' '\n' | sort -n | xargs)"
  run_step sft-resumed "$sft_pattern" "$maxtext_python" -m maxtext.trainers.post_train.sft.train_sft "${args[@]}"
}

# require WHAT PATTERN...: exits unless each glob PATTERN names at least one file.
require() {
  local what=$1 pattern
  shift
  for pattern in "$@"; do
    if ! compgen -G "$pattern" >/dev/null; then
      echo "plain_pipeline.sh: no $what at $pattern (scripts/bootstrap.sh builds it)" >&2
      exit 1
    fi
  done
}

require "MaxText venv" "$maxtext_python"
rm -rf "$converted" "$work/sft" "$work/rl" "$work/hf-sft" "$work/hf-rl" "$logs"
mkdir -p "$logs"
run_step tiny-model 'built|exists' "$maxtext_python" "$local_src/tiny_model.py" --out "$tiny"
# What the steps read, checked before the clock starts (the trainers' own errors come after minutes of imports).
require "launcher" "$launchers"/{to_maxtext,to_huggingface,train_rl}_cpu.py
require "tiny model" "$hf_model"/{config.json,model.safetensors,tokenizer.json}
require "SFT dataset repo (split train_sft)" "$chats/README.md" "$chats/data/train_sft-*.parquet"
$sft_only || require "GSM8K-shaped dataset repo" "$gsm8k/main/train-*.parquet" "$gsm8k/main/test-*.parquet"
start=$EPOCHREALTIME
run_step convert 'Conversion complete|Peak Memory' \
  "$maxtext_python" "$launchers/to_maxtext_cpu.py" "${convert_args[@]}"
run_step sft "$sft_pattern" \
  "$maxtext_python" -m maxtext.trainers.post_train.sft.train_sft "${sft_args[@]}" run_name=sft steps="$sft_steps"
export_step export-sft "$work/sft/sft/checkpoints/$sft_steps/model_params" "$work/hf-sft"
last=export-sft
if ! $sft_only; then
  run_step rl 'Pre RL Training|Post RL Training|RL Training Completed' \
    "$maxtext_python" "$launchers/train_rl_cpu.py" "${rl_args[@]}"
  export_step export-rl "$work/rl/rl/checkpoints/actor/$rl_batches/model_params" "$work/hf-rl"
  last=export-rl
fi
printf '%-14s %7s s   (convert to %s)\n' "pipeline total" "$(elapsed "$start")" "$last"

if [[ -x "$hfcheck_python" ]]; then
  run_step check-hf-sft 'generated' "$hfcheck_python" "$local_src/check_hf_model.py" "$work/hf-sft"
  $sft_only || run_step check-hf-rl 'generated' "$hfcheck_python" "$local_src/check_hf_model.py" "$work/hf-rl"
else
  echo "skipping the transformers load/generate check: no $hfcheck_python"
fi
if $resume_check; then
  check_sft_resume
fi
