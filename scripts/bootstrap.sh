#!/usr/bin/env bash
# Idempotent set-up of everything the local run and the tests need: Debian packages (sshd, docker-compose
# for validating the compose file, chromium for the trigger form's browser test, PostgreSQL and Redis for the
# compose deployment's test), uv, the Airflow venv (.venv) and the local "VM"'s MaxText venv.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
command -v curl >/dev/null 2>&1 || need_apt+=(curl ca-certificates)  # the VMs' TLS client (tests/test_local_vm.py)
command -v setfacl >/dev/null 2>&1 || need_apt+=(acl)  # the local checkpoint storage: writable by every login
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)  # the local VPC's masquerade: a VM with an external IP or NAT reaches PyPI (local/vpc.py)
[ -x /usr/bin/chromium ] || need_apt+=(chromium)  # driven by Playwright in tests/test_trigger_form.py
# docker-compose.yaml's metadata DB and Celery broker, run as processes by tests/test_deployment.py
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need_apt+=(postgresql)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv

find_python312() {
  local candidate
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      command -v "$candidate" 2>/dev/null || echo "$candidate"
      return 0
    fi
  done
  echo "bootstrap: Python 3.12 not found (install it, e.g. with pyenv)" >&2
  return 1
}
PY312=$(find_python312)

if [ ! -x .venv/bin/python ]; then
  uv venv -q -p "$PY312" .venv
fi
# The versions of requirements/test.lock (what the last green run used); updating it is a deliberate commit.
uv pip install -q -p .venv/bin/python -r requirements/test.lock -e . --group test
# The local "VM"'s image: MaxText's CPU venv (through the same install script the pipeline runs) and the tiny
# model; and the venv that checks an exported model loads in transformers.
TPU_POSTTRAIN_PYTHON312="$PY312" .venv/bin/python -m airflow_tpu_posttrain.local.stack prepare .local
airflow_tpu_posttrain/local/setup_hfcheck.sh
echo "bootstrap: ready"
