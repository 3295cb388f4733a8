#!/usr/bin/env bash
# Creates the venv that checks an exported model loads and generates with transformers (check_hf_model.py), and a
# LoRA adapter with PEFT (check_peft_adapter.py): Python 3.11 + torch (CPU) + transformers + peft.  setup_hfcheck.sh [VENV]  (default <repo>/.local/hfcheck-venv)
#
# Built with uv. PyPI's Linux torch wheel is the CUDA build (GBs of nvidia packages): where pip's find-links
# (PIP_FIND_LINKS or pip.conf) hold the CPU wheel, as on these machines for Python 3.11, that file is installed;
# elsewhere uv takes torch from PyTorch's CPU index (--torch-backend=cpu). Idempotent: a marker holds the specs it
# was built from; when it matches, the venv is left alone.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-${TPU_POSTTRAIN_HFCHECK_VENV:-$repo/.local/hfcheck-venv}}
torch_version=2.13.0
specs=("torch==$torch_version" "transformers" "peft")
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
uv venv -q -p "$python311" "$venv"
find_links=${PIP_FIND_LINKS:-$("$python311" -m pip config get global.find-links 2>/dev/null || true)}
cpu_wheel=$(compgen -G "${find_links:-/nonexistent}/torch-$torch_version+cpu-cp311-cp311-*linux*_x86_64.whl" | head -n 1 || true)
if [[ -n "$cpu_wheel" ]]; then
  uv pip install -q -p "$venv/bin/python" "$cpu_wheel" transformers peft
else
  uv pip install -q -p "$venv/bin/python" --torch-backend=cpu "${specs[@]}"
fi
"$venv/bin/python" -c 'import torch, transformers, peft; assert torch.version.cuda is None, "expected a CPU torch build"'
echo "$marker" >"$venv/.tpu-posttrain-setup"
echo "$venv: built in $((SECONDS - started)) s, $(du -sh "$venv" | cut -f1)"
