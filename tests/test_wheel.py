"""What a user installs: the wheel alone, in a fresh venv, runs their models.

The wheel is built from this checkout and installed with nothing else of the repository (the versions of
requirements/test.lock, from uv's cache); Airflow there lists the provider and parses the DAGs the wheel ships and
a user's DAG folder holding only a models.yaml and the few-line DAG file README shows."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# README's DAG file for a user's DAG folder, beside their models.yaml.
USER_DAG_FILE = '''
"""Post-training DAGs, one per (recipe, model) entry of models.yaml, and the TPU VM reaper."""

from pathlib import Path

from airflow_tpu_posttrain.pipelines.posttrain import build_dag
from airflow_tpu_posttrain.pipelines.reaper import build_reaper_dag
from airflow_tpu_posttrain.pipelines.registry import load_registry

configs = load_registry(Path(__file__).with_name("models.yaml"), local=False)
globals().update({config.dag_id: build_dag(config) for config in configs})
tpu_vm_reaper = build_reaper_dag(configs)
'''

# Run in the wheel's venv: the DAG ids and import errors of each folder, and the provider's name and version.
PARSE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import airflow_tpu_posttrain
    from airflow.dag_processing.dagbag import DagBag

    examples = Path(airflow_tpu_posttrain.__file__).with_name("example_dags")
    out = {"package": airflow_tpu_posttrain.__file__}
    for name, folder in (("examples", examples), ("user", Path(sys.argv[1]))):
        bag = DagBag(dag_folder=str(folder))
        out[name] = {"dags": sorted(bag.dags), "errors": {k: v[-400:] for k, v in bag.import_errors.items()}}
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    python = getattr(sys, "_base_executable", sys.executable)
    # The sdist, then the wheel built from it (uv build's default): nothing of the checkout's build/ can slip in.
    subprocess.run(["uv", "build", "-q", "-p", python, "-o", str(out / "dist"), str(REPO)], check=True)
    [wheel] = (out / "dist").glob("*.whl")
    venv = out / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", python, str(venv)], check=True)
    subprocess.run(
        ["uv", "pip", "install", "-q", "-p", str(venv / "bin" / "python"), "-c", str(REPO / "requirements" / "test.lock"),
         str(wheel)],
        check=True,
    )
    return venv


def _in_wheel_venv(venv: Path, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("AIRFLOW", "TPU_POSTTRAIN", "PYTHON"))
    }
    env.update(AIRFLOW_HOME=str(tmp_path / "airflow-home"), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_the_wheel_alone_runs_a_users_own_model(wheel_venv, tmp_path):
    registry = yaml.safe_load((REPO / "dags" / "models.yaml").read_text())
    registry["models"] = {
        "qwen3-8b": {"hf_source": "Qwen/Qwen3-8B", "maxtext_model_name": "qwen3-8b", "maxtext_version": "0.2.5"}
    }
    registry["pipelines"] = [{"model": "qwen3-8b", "recipe": "sft", "hub_repo_id": "my-org/qwen3-8b-sft"}]
    user_dags = tmp_path / "dags"
    user_dags.mkdir()
    (user_dags / "models.yaml").write_text(yaml.safe_dump(registry))
    (user_dags / "posttrain.py").write_text(USER_DAG_FILE)

    parsed = _in_wheel_venv(wheel_venv, tmp_path, "python", "-c", PARSE, str(user_dags))
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    found = json.loads(parsed.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(wheel_venv)  # the wheel's copy, not this checkout
    assert found["user"] == {"dags": ["posttrain_sft__qwen3-8b", "tpu_vm_reaper"], "errors": {}}
    assert found["examples"] == {
        "dags": [
            "posttrain_rl__llama3.1-8b-Instruct",
            "posttrain_sft__gemma3-4b",
            "posttrain_sft__gemma3-4b__lora",
            "posttrain_sft__gemma3-4b__slice",
            "sft_tutorial_by_hand",
            "tpu_vm_reaper",
        ],
        "errors": {},
    }

    provider = _in_wheel_venv(wheel_venv, tmp_path, "airflow", "providers", "get", "airflow-tpu-posttrain", "-o", "json")
    assert provider.returncode == 0, provider.stderr[-3000:]
    from airflow_tpu_posttrain import __version__

    [info] = json.loads(provider.stdout[provider.stdout.index("[") :])
    assert info == {"Provider": "airflow-tpu-posttrain", "Version": __version__}


def test_the_wheel_ships_no_local_stand_ins_and_the_readme_shows_its_dag_file(wheel_venv):
    site = next((wheel_venv / "lib").glob("python3.*/site-packages"))
    package = site / "airflow_tpu_posttrain"
    assert not (package / "local").exists() and (package / "py.typed").is_file()
    assert shutil.which("airflow", path=str(wheel_venv / "bin"))
    code = USER_DAG_FILE.split('"""', 2)[2].strip()
    unindented_readme = "\n".join(line.strip() for line in (REPO / "README.md").read_text().splitlines())
    assert "\n".join(line.strip() for line in code.splitlines()) in unindented_readme


def test_the_images_copy_of_the_source_builds_the_same_wheel(tmp_path):
    """The Dockerfile's COPY lines give pip all the wheel needs (its license file, what example_dags/ links to).

    No Docker engine here: the COPYs are replayed into a folder, which is built as the image's pip builds it."""
    import zipfile

    dockerfile = (REPO / "Dockerfile").read_text()
    copies = re.findall(r"^COPY --chown=\S+ (.+)$", dockerfile, flags=re.MULTILINE)
    [install] = re.findall(r'^RUN pip install --no-cache-dir "apache-airflow==\$\{AIRFLOW_VERSION\}" (\S+)$', dockerfile,
                           flags=re.MULTILINE)
    image = tmp_path / "image"
    for copy in copies:
        *sources, target = copy.split()
        for source in sources:
            destination = image / target.lstrip("/")
            if source.endswith("/"):
                shutil.copytree(REPO / source, destination / "" if target.endswith("/") else destination,
                                symlinks=True, dirs_exist_ok=True)
            else:
                destination.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / source, destination / source)
    source_dir = image / install.lstrip("/")
    python = getattr(sys, "_base_executable", sys.executable)
    built = subprocess.run(["uv", "build", "--wheel", "-q", "-p", python, "-o", str(tmp_path / "dist"), str(source_dir)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"airflow_tpu_posttrain/example_dags/models.yaml", "airflow_tpu_posttrain/example_dags/posttrain_dags.py"} <= set(names)
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)


def test_the_compatibility_table_says_what_is_required_and_tested():
    """docs/compatibility.md's rows against pyproject.toml's requirements, the lock file and the model profiles."""
    import tomllib

    from test_composer_floor import COMPOSER_PYTHON, floor_requirements

    from airflow_tpu_posttrain.recipes.models import MODELS

    rows, lowest = {}, {}
    for line in (REPO / "docs" / "compatibility.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("component", "---"):
            rows[cells[0]] = (cells[1], cells[3])
            lowest[cells[0]] = cells[2]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lock = dict(
        line.split("==", 1) for line in (REPO / "requirements" / "test.lock").read_text().splitlines() if "==" in line
    )
    floors = dict(pinned.split("==") for pinned in floor_requirements())
    for requirement in project["dependencies"]:
        name, required = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()
        assert rows[name] == (required, lock[name.replace("_", "-").lower()]), name
        assert lowest[name] == floors[name], name  # what tests/test_composer_floor.py installs
    assert rows["Python"][0] == project["requires-python"] and lowest["Python"] == COMPOSER_PYTHON
    assert rows["MaxText on the TPU VM: SFT of `gemma3-4b`"][0].startswith(MODELS["gemma3-4b"].maxtext_version)
    assert rows["MaxText on the TPU VM: GRPO of `llama3.1-8b-Instruct`"][0].startswith(
        MODELS["llama3.1-8b-Instruct"].maxtext_version
    )
    assert rows["MaxText on the local CPU \"VM\" (`tiny-llama`, the fault tests' model)"][0] == MODELS[
        "tiny-llama"
    ].maxtext_version
    for cloud, row in (("gemma3-4b", "SFT of `gemma3-4b`"), ("llama3.1-8b-Instruct", "GRPO of `llama3.1-8b-Instruct`")):
        twin = MODELS[f"tiny-{cloud}"]
        assert f"maxtext-v{twin.maxtext_version}" in rows[f"MaxText on the TPU VM: {row}"][1]
        assert f"`{twin.key}`" in rows[f"MaxText on the TPU VM: {row}"][1]
