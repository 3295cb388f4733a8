#!/usr/bin/env bash
# The airflow-init service of docker-compose.yaml, run as root before any other Airflow service starts:
# shared secrets, volume ownership, metadata DB, admin password, the tpu_vms pool and the DAGs' connections.
#
# Idempotent: an existing secret file or connection is kept, so re-running it never rotates a key (which
# would make the stored connections undecryptable) nor overwrites a connection edited in the UI. To
# re-create a connection from .env, delete it (`airflow connections delete ID`) and re-run airflow-init.
# No secret value is ever printed or passed on a command line.
set -euo pipefail
umask 077

# The image's paths. tests/test_deployment.py runs this script outside the image, with its own AIRFLOW_HOME and
# AIRFLOW_IMAGE_ENTRYPOINT empty (the Airflow of its PATH needs no entrypoint).
airflow_home=${AIRFLOW_HOME:-/opt/airflow}
entrypoint=${AIRFLOW_IMAGE_ENTRYPOINT-/entrypoint}
secrets_dir=$airflow_home/secrets
airflow_uid=${AIRFLOW_UID:-50000}

# write_secret FILE VALUE: VALUE (from .env) when given, else the existing file, else a random value.
# No trailing newline: Airflow's *_CMD options use the command's output verbatim. The random value is
# url-safe base64 of 32 bytes, which is also the format of a Fernet key. Plain stdlib Python, because root
# only sees the packages of the image's airflow user through /entrypoint, and /entrypoint needs these files.
write_secret() {
  local file=$secrets_dir/$1 value=$2
  if [[ -n $value ]]; then
    printf '%s' "$value" >"$file"
  elif [[ ! -s $file ]]; then
    python -c 'import base64, os, sys; sys.stdout.write(base64.urlsafe_b64encode(os.urandom(32)).decode())' \
      >"$file"
  fi
}
write_secret fernet_key "${AIRFLOW_FERNET_KEY:-}"
write_secret jwt_secret "${AIRFLOW_JWT_SECRET:-}"
write_secret api_secret_key "${AIRFLOW_API_SECRET_KEY:-}"

# The api-server (SimpleAuthManager) reads the admin password from this file, and generates and logs one
# for a user the file lacks; so set it only when AIRFLOW_ADMIN_PASSWORD is given.
if [[ -n ${AIRFLOW_ADMIN_PASSWORD:-} ]]; then
  python - <<'PY'
import json
import os

path = os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]
try:
    with open(path) as file:
        passwords = json.loads(file.read().strip() or "{}")
except FileNotFoundError:
    passwords = {}
passwords["admin"] = os.environ["AIRFLOW_ADMIN_PASSWORD"]
with open(path, "w") as file:
    json.dump(passwords, file)
PY
fi

# The services run as AIRFLOW_UID (group 0); named volumes start out owned by root or by the image's uid.
chown -R "$airflow_uid:0" "$secrets_dir" "$airflow_home/logs"

# From here on Airflow runs, through the image's entrypoint: it waits for the DB and makes the airflow
# user's packages importable for root.
$entrypoint airflow db migrate
# Deferred tasks counted: a training waiting in the triggerer keeps its slot (README, "What caps what").
$entrypoint airflow pools set --include-deferred tpu_vms "${TPU_VM_POOL_SLOTS:-2}" "Concurrent TPU VM steps"

if [[ ! -r ${TPU_SSH_KEY_FILE:-} ]]; then
  echo "airflow-init: WARNING: TPU_SSH_KEY_FILE (${TPU_SSH_KEY_FILE:-unset}) is not a readable file;" \
    "put the key in the credentials directory (see deploy/.env.example)" >&2
fi
if [[ -n ${GCP_KEY_PATH:-} && ! -r $GCP_KEY_PATH ]]; then
  echo "airflow-init: WARNING: GCP_KEY_PATH ($GCP_KEY_PATH) is not a readable file" >&2
fi

# The connections go through a 0600 temporary file (`connections import` picks its parser by the .json
# suffix) so that the HF token never appears in a process list. `import` skips an ID that already exists,
# printing "connection already exists": that is the idempotent path, not an error.
connections_file=$(mktemp --suffix=.json)
trap 'rm -f "$connections_file"' EXIT
python - "$connections_file" <<'PY'
import json
import os
import sys

env = os.environ.get
# key_path unset: the Google provider falls back to Application Default Credentials.
gcp_extra = {"project": env("GCP_PROJECT"), "key_path": env("GCP_KEY_PATH")}
gcp_extra = {key: value for key, value in gcp_extra.items() if value}
connections = {
    "google_cloud_default": {"conn_type": "google_cloud_platform", "extra": json.dumps(gcp_extra)},
    # No host: the operators connect to the address of the TPU VM they created.
    "tpu_vm_ssh": {
        "conn_type": "ssh",
        "login": env("TPU_SSH_USER"),
        "extra": json.dumps({"key_file": env("TPU_SSH_KEY_FILE")}),
    },
}
# An hf_default without a token would be kept as is once HF_TOKEN is set later, so create it only with one.
if env("HF_TOKEN"):
    connections["hf_default"] = {"conn_type": "tpu_posttrain_huggingface", "password": env("HF_TOKEN")}
else:
    print("airflow-init: HF_TOKEN is not set, so hf_default is neither created nor changed", file=sys.stderr)
with open(sys.argv[1], "w") as file:
    json.dump(connections, file)
PY
$entrypoint airflow connections import "$connections_file"
