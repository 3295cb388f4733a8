#!/usr/bin/env bash
# Baseline: MaxText's post-training steps for the tiny local model, run by a plain shell script.
#
#   bench/plain_pipeline.sh [--sft-only] [--resume-check] [WORK_DIR]      (WORK_DIR default: .local/bench-plain)
#
# convert (HF -> MaxText) -> SFT -> export to HF;  convert -> RL (GRPO) -> export to HF; then, if the
# torch venv exists, checks that the exports load in transformers and generate. Prints each step's
# wall time and peak RSS plus its key log lines; full logs go to WORK_DIR/logs. Each run starts from
# a clean WORK_DIR (the tiny model and data are kept: building them is idempotent).
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
local_dir=$repo/airflow_tpu_posttrain/local
launchers=$local_dir/vm_launchers
logs=$work/logs

export JAX_PLATFORMS=cpu TRANSFORMERS_VERBOSITY=error

tiny=$work/tiny
hf_model=$tiny/tiny-llama
converted=$work/converted
model_name=llama3.1-8b
dims=(override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2
  base_num_decoder_layers=2 base_mlp_dim=128 head_dim=16 vocab_size=512)
cpu=(hardware=cpu skip_jax_distributed_system=true attention=dot_product)
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
  "${cpu[@]}" "${dims[@]}" --hf_model_path="$hf_model" --lazy_load_tensors=True)
# checkpoint_period: the default (10000) saves only step 1 and the last step, leaving a retry little to resume.
sft_args=(model_name="$model_name" load_parameters_path="$converted/0/items" base_output_directory="$work/sft"
  "${cpu[@]}" "${dims[@]}" hf_path=json hf_train_files="$tiny/data/sft.jsonl" train_split=train
  "train_data_columns=['messages']" hf_eval_split= tokenizer_path="$hf_model" max_target_length=128
  per_device_batch_size=1 checkpoint_period=2)
rl_args=(model_name="$model_name" load_parameters_path="$converted/0/items" run_name=rl base_output_directory="$work/rl"
  "${dims[@]}" chips_per_vm=1 num_batches="$rl_batches" num_test_batches=2
  rollout_data_parallelism=1 rollout_tensor_parallelism=-1 tokenizer_path="$hf_model"
  hf_train_files="$tiny/data/gsm8k/train.parquet" hf_eval_files="$tiny/data/gsm8k/test.parquet"
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

rm -rf "$converted" "$work/sft" "$work/rl" "$work/hf-sft" "$work/hf-rl" "$logs"
mkdir -p "$logs"
run_step tiny-model 'built|exists' "$maxtext_python" "$local_dir/tiny_model.py" --out "$tiny"
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
  run_step check-hf-sft 'generated' "$hfcheck_python" "$local_dir/check_hf_model.py" "$work/hf-sft"
  $sft_only || run_step check-hf-rl 'generated' "$hfcheck_python" "$local_dir/check_hf_model.py" "$work/hf-rl"
else
  echo "skipping the transformers load/generate check: no $hfcheck_python"
fi
if $resume_check; then
  check_sft_resume
fi
