#!/usr/bin/env bash
# Creates the venvs of the local CPU "VM" (this machine, reached over SSH on 127.0.0.1).
#
#   setup_maxtext_cpu.sh [MAXTEXT_VENV] [--with-torch-check [HFCHECK_VENV]]
#
# MAXTEXT_VENV (default $TPU_POSTTRAIN_MAXTEXT_VENV, else <repo>/.local/maxtext-venv): Python 3.12, MaxText on CPU, plus what
#   tiny_model.py needs. Built with uv. maxtext[tpu-post-train] cannot be installed here (its torch
#   index and GitHub-hosted extras are unreachable), so this installs maxtext[tpu] + google-tunix and
#   overrides tunix's `safetensors<0.8` pin, which conflicts with maxtext's `>=0.8`.
# HFCHECK_VENV (default $TPU_POSTTRAIN_HFCHECK_VENV, else <repo>/.local/hfcheck-venv): Python 3.11 + torch (CPU) + transformers, for
#   check_hf_model.py. Built with pip: the CPU torch wheel is only on local disk for 3.11 (pip's
#   find-links); uv would fetch a multi-GB CUDA build instead.
#
# Idempotent: each venv holds a marker with the exact specs it was built from; when it matches, the
# venv is left alone. A venv without a matching marker (interrupted or older build) is rebuilt.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)

PYTHON312=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
PYTHON311=${PYTHON311:-/root/.pyenv/versions/3.11.7/bin/python3.11}
MARKER_NAME=.tpu-posttrain-setup

MAXTEXT_SPECS=("maxtext[tpu]==0.2.5" "google-tunix==0.1.7")  # brings tokenizers, transformers, pyarrow
MAXTEXT_OVERRIDES="safetensors>=0.8.0"
HFCHECK_SPECS=("torch==2.13.0" "transformers")

maxtext_venv=${TPU_POSTTRAIN_MAXTEXT_VENV:-$repo/.local/maxtext-venv}
hfcheck_venv=""
while (($#)); do
  case "$1" in
    --with-torch-check)
      hfcheck_venv=${TPU_POSTTRAIN_HFCHECK_VENV:-$repo/.local/hfcheck-venv}
      if (($# > 1)) && [[ "$2" != --* ]]; then hfcheck_venv=$2; shift; fi
      ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    --*) echo "unknown option: $1" >&2; exit 2 ;;
    *) maxtext_venv=$1 ;;
  esac
  shift
done

# Prints "up to date" and returns 0 when $1 holds a marker equal to $2.
venv_is_current() {
  local venv=$1 wanted=$2
  if [[ -f "$venv/$MARKER_NAME" && "$(cat "$venv/$MARKER_NAME")" == "$wanted" ]]; then
    echo "$venv: up to date"
    return 0
  fi
  return 1
}

# Deletes $1 so it can be rebuilt, refusing a non-empty directory that is not a venv.
remove_stale_venv() {
  local venv=$1
  if [[ -d "$venv" && ! -f "$venv/pyvenv.cfg" && -n "$(ls -A "$venv")" ]]; then
    echo "refusing to replace $venv: not a venv" >&2
    exit 1
  fi
  rm -rf "$venv"
}

report() {
  local venv=$1 started=$2
  echo "$venv: built in $((SECONDS - started)) s, $(du -sh "$venv" | cut -f1)"
}

setup_maxtext_venv() {
  local venv=$1 marker started=$SECONDS
  marker=$(printf '%s\n' "python=3.12" "${MAXTEXT_SPECS[@]}" "override:$MAXTEXT_OVERRIDES")
  venv_is_current "$venv" "$marker" && return 0
  remove_stale_venv "$venv"
  uv venv --quiet --python "$PYTHON312" "$venv"
  local overrides
  overrides=$(mktemp)
  echo "$MAXTEXT_OVERRIDES" >"$overrides"
  uv pip install --quiet --python "$venv/bin/python" --overrides "$overrides" "${MAXTEXT_SPECS[@]}"
  rm -f "$overrides"
  JAX_PLATFORMS=cpu TRANSFORMERS_VERBOSITY=error "$venv/bin/python" -c \
    'import maxtext, tunix, tokenizers, transformers, safetensors, pyarrow'
  echo "$marker" >"$venv/$MARKER_NAME"
  report "$venv" "$started"
}

setup_hfcheck_venv() {
  local venv=$1 marker started=$SECONDS
  marker=$(printf '%s\n' "python=3.11" "${HFCHECK_SPECS[@]}")
  venv_is_current "$venv" "$marker" && return 0
  remove_stale_venv "$venv"
  "$PYTHON311" -m venv "$venv"
  # This machine's pip.conf names index folders that may be absent; pip warns once per package.
  "$venv/bin/python" -m pip install --quiet "${HFCHECK_SPECS[@]}" 2> >(grep -v '^WARNING: Location' >&2)
  "$venv/bin/python" -c 'import torch, transformers; assert torch.version.cuda is None, "expected a CPU torch build"'
  echo "$marker" >"$venv/$MARKER_NAME"
  report "$venv" "$started"
}

setup_maxtext_venv "$maxtext_venv"
if [[ -n "$hfcheck_venv" ]]; then
  setup_hfcheck_venv "$hfcheck_venv"
fi
