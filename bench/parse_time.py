"""P3: parse time of each DAG file on top of importing Airflow, and what each one imports.

    .venv/bin/python bench/parse_time.py [--runs 5]

Each run is a fresh interpreter: import Airflow and build a trivial DAG (what a DAG processor has already done
before it parses a file: Airflow's lazily loaded parts are loaded), then time the DAG file's import. Prints the
median per file and the heavy modules (cloud clients, SSH libraries, jax) it pulled in. The modules' bytecode is
there, as in a deployment (pip compiles it at install; a DAG processor writes it at its first parse): a first,
unmeasured run writes what is missing, whatever PYTHONDONTWRITEBYTECODE says here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = (
    "google.cloud.compute_v1",
    "googleapiclient",
    "huggingface_hub",
    "jax",
    "paramiko",
    "asyncssh",
    "transformers",
)
PROBE = """
import importlib.util, json, sys, time
t0 = time.perf_counter()
import airflow, airflow.sdk
with airflow.sdk.DAG("warm_up", schedule=None):
    airflow.sdk.BaseOperator(task_id="t")
t1 = time.perf_counter()
before = set(sys.modules)
spec = importlib.util.spec_from_file_location("dagfile", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
t2 = time.perf_counter()
heavy = sorted(m for m in set(sys.modules) - before if m in json.loads(sys.argv[2]))
dags = sum(isinstance(v, airflow.sdk.DAG) for v in vars(module).values())
print(json.dumps({"airflow_s": t1 - t0, "dag_file_s": t2 - t1, "heavy": heavy, "dags": dags}))
"""


def measure(dag_file: Path, runs: int) -> dict:
    env = {**os.environ, "AIRFLOW_HOME": tempfile.mkdtemp(), "TPU_POSTTRAIN_LOCAL_DIR": str(REPO / ".local")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    samples = []
    for _ in range(runs + 1):
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(dag_file), json.dumps(HEAVY)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
    samples = samples[1:]  # the first wrote the bytecode
    return {
        "airflow_ms": statistics.median(s["airflow_s"] for s in samples) * 1000,
        "dag_file_ms": statistics.median(s["dag_file_s"] for s in samples) * 1000,
        "heavy": samples[-1]["heavy"],
        "dags": samples[-1]["dags"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'DAG file':28} {'DAGs':>4} {'Airflow + warm-up':>17} {'DAG file':>10} {'per DAG':>9}  heavy imports"
    )
    for dag_file in sorted((REPO / "dags").glob("*.py")):
        result = measure(dag_file, args.runs)
        dags = result["dags"]
        print(
            f"{dag_file.name:28} {dags:>4} {result['airflow_ms']:>14.0f} ms {result['dag_file_ms']:>7.0f} ms "
            f"{result['dag_file_ms'] / max(dags, 1):>6.0f} ms  {', '.join(result['heavy']) or 'none'}"
        )


if __name__ == "__main__":
    main()
