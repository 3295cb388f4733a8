#!/usr/bin/env bash
# Creates the venv that checks an exported model loads and generates with transformers (check_hf_model.py):
# Python 3.11 + torch (CPU) + transformers.  setup_hfcheck.sh [VENV]  (default <repo>/.local/hfcheck-venv)
#
# Built with pip: on these machines the CPU torch wheel lies on local disk only for Python 3.11 (pip's
# find-links); uv would fetch a multi-GB CUDA build instead. Idempotent: a marker holds the specs it was built
# from; when it matches, the venv is left alone.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-${TPU_POSTTRAIN_HFCHECK_VENV:-$repo/.local/hfcheck-venv}}
specs=("torch==2.13.0" "transformers")
marker=$(printf '%s\n' "python=3.11" "${specs[@]}")

if [[ -f "$venv/.tpu-posttrain-setup" && "$(cat "$venv/.tpu-posttrain-setup")" == "$marker" ]]; then
  echo "$venv: up to date"
  exit 0
fi
python311=${PYTHON311:-}
for candidate in "$python311" python3.11 "$HOME"/.pyenv/versions/3.11*/bin/python3.11; do
  if [[ -n "$candidate" ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    python311=$candidate
    break
  fi
done
started=$SECONDS
rm -rf "$venv"
"$python311" -m venv "$venv"
# This machine's pip.conf names index folders that may be absent; pip warns once per package.
"$venv/bin/python" -m pip install --quiet "${specs[@]}" 2> >(grep -v '^WARNING: Location' >&2)
"$venv/bin/python" -c 'import torch, transformers; assert torch.version.cuda is None, "expected a CPU torch build"'
echo "$marker" >"$venv/.tpu-posttrain-setup"
echo "$venv: built in $((SECONDS - started)) s, $(du -sh "$venv" | cut -f1)"
