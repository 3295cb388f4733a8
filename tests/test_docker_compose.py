"""The docker-compose deployment: the file validates with docker-compose.

The resolved configuration has the official Airflow 3 layout running this provider's image, with no secret
written into the file."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yaml"
INIT_SCRIPT = ROOT / "deploy" / "init.sh"

AIRFLOW_SERVICES = {
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-worker",
    "airflow-triggerer",
    "airflow-init",
}
LONG_RUNNING = (AIRFLOW_SERVICES - {"airflow-init"}) | {"postgres", "redis"}
HF_TOKEN_SENTINEL = "hf-token-sentinel-from-the-environment"
# Variables that hold secrets (not those naming a file or command that yields one): each must come from the
# environment, never as a literal in the file.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|FERNET")
FROM_ENV = re.compile(r"^\$\{(?P<name>[A-Z0-9_]+)(?::-(?P<default>[^}]*))?\}$")


def _compose(*args: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """docker-compose on the repository's file with only ``env``: an empty env file, not a developer's .env."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip(
            "docker-compose is not installed: scripts/bootstrap.sh installs it (Debian's docker-compose)"
        )
    env_file = tmp_path / "empty.env"
    env_file.touch()
    return subprocess.run(
        [binary, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The resolved configuration (anchors merged, variables substituted), HF_TOKEN set to a sentinel."""
    result = _compose(
        "config", tmp_path=tmp_path_factory.mktemp("compose"), env={"HF_TOKEN": HF_TOKEN_SENTINEL}
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """The file as written, variables unsubstituted."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Target → (source, read-only), from the short (docker-compose 1.x) or long (Compose v2) syntax."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts[target] = (source, mode == ["ro"])
        else:
            mounts[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
    return mounts


def test_config_validates(tmp_path: Path) -> None:
    result = _compose("config", "-q", tmp_path=tmp_path, env={})
    assert result.returncode == 0, result.stderr


def test_official_airflow3_services(config: dict[str, Any], raw: dict[str, Any]) -> None:
    services = config["services"]
    assert AIRFLOW_SERVICES | {"postgres", "redis"} <= services.keys()
    assert "x-airflow-common" in raw
    assert services["postgres"]["image"] == "postgres:16"
    assert services["redis"]["image"] == "redis:7.2-bookworm"
    assert services["airflow-apiserver"]["command"] == "api-server"
    assert {port["target"] for port in services["airflow-apiserver"]["ports"]} == {8080}
    for name in LONG_RUNNING:
        assert "test" in services[name]["healthcheck"], name
    for name in AIRFLOW_SERVICES - {"airflow-init"}:
        assert services[name]["depends_on"]["airflow-init"] == {"condition": "service_completed_successfully"}


def test_airflow_services_run_the_built_image(config: dict[str, Any], raw: dict[str, Any]) -> None:
    assert raw["x-airflow-common"]["build"] == {"context": "."}
    images = set()
    for name in AIRFLOW_SERVICES:
        service = config["services"][name]
        assert Path(service["build"]["context"]) == ROOT, name
        images.add(service["image"])
    assert len(images) == 1, "all Airflow services must share the one built image"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM apache/airflow:3.3.2-python3.12" in dockerfile
    assert "pip install --no-cache-dir" in dockerfile
    # The iap path's tunnel needs gcloud in every Airflow service (workers and triggerer): on the PATH, checked.
    assert 'ENV PATH="${GCLOUD_HOME}/bin/:${PATH}"' in dockerfile and "&& gcloud --version" in dockerfile
    assert dockerfile.index("gcloud --version") < dockerfile.index("USER airflow")  # installed as root, then dropped


def test_dags_read_only_and_logs_volume(config: dict[str, Any]) -> None:
    for name in AIRFLOW_SERVICES - {"airflow-init"}:
        mounts = _mounts(config["services"][name])
        assert mounts["/opt/airflow/dags"] == (str(ROOT / "dags"), True), name
        assert mounts["/opt/airflow/logs"][0] == "airflow-logs", name
    assert "airflow-logs" in config["volumes"]


def test_celery_executor_with_postgres_and_redis(config: dict[str, Any]) -> None:
    for name in AIRFLOW_SERVICES:
        env = config["services"][name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://"), name
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://"), name
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "false"
    assert config["services"]["airflow-worker"]["command"] == "celery worker"


def test_triggerer_runs_for_deferrable_operators(config: dict[str, Any]) -> None:
    assert config["services"]["airflow-triggerer"]["command"] == "triggerer"


def test_init_creates_db_pool_and_connections(config: dict[str, Any]) -> None:
    init = config["services"]["airflow-init"]
    assert init["command"] == "/opt/airflow/deploy/init.sh"
    assert _mounts(init)["/opt/airflow/deploy/init.sh"] == (str(INIT_SCRIPT), True)
    script = INIT_SCRIPT.read_text()
    # tests/test_deployment.py runs the script (against PostgreSQL) and checks what it made; here, that in the
    # image it runs Airflow through the image's entrypoint.
    assert "entrypoint=${AIRFLOW_IMAGE_ENTRYPOINT-/entrypoint}" in script
    for step in ("airflow db migrate", "airflow pools set --include-deferred tpu_vms", "airflow connections import"):
        assert f"$entrypoint {step}" in script, step
    for conn_id, conn_type in [
        ("google_cloud_default", "google_cloud_platform"),
        ("tpu_vm_ssh", "ssh"),
        ("hf_default", "tpu_posttrain_huggingface"),
    ]:
        assert re.search(rf'"{conn_id}"[^{{]*{{\s*"conn_type": "{conn_type}"', script), conn_id
    assert '"password": env("HF_TOKEN")' in script


def test_no_secret_in_the_file(config: dict[str, Any], raw: dict[str, Any]) -> None:
    environments = [raw["x-airflow-common"]["environment"]]
    environments += [service.get("environment", {}) for service in raw["services"].values()]
    for env in environments:
        for name, value in env.items():
            if SECRET_NAME.search(name) and not name.endswith(("_CMD", "_FILE")):  # those name files
                assert FROM_ENV.match(str(value)), f"{name} must come from the environment, not {value!r}"
    # The HF token has no default and reaches only airflow-init, which stores it in the connection.
    assert FROM_ENV.match(raw["services"]["airflow-init"]["environment"]["HF_TOKEN"])["default"] == ""
    holders = [name for name, service in config["services"].items() if HF_TOKEN_SENTINEL in str(service)]
    assert holders == ["airflow-init"]
    # The shared keys are read from the files airflow-init writes, not set in the file.
    common = raw["x-airflow-common"]["environment"]
    for option in ["AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"]:
        assert option not in common
        assert common[f"{option}_CMD"].startswith("cat /opt/airflow/secrets/")


def test_the_process_deployment_reads_the_file_as_docker_compose_does(config: dict[str, Any], tmp_path: Path) -> None:
    """tests/test_deployment.py's services get what docker-compose resolves: environment, command, healthcheck."""
    from airflow_tpu_posttrain.local.deployment import ComposeDeployment, interpolate

    deployment = ComposeDeployment(tmp_path, {"HF_TOKEN": HF_TOKEN_SENTINEL}, {})
    for name in AIRFLOW_SERVICES | {"postgres", "redis"}:
        ours, theirs = deployment.service(name), config["services"][name]
        environment = {key: interpolate(str(value), deployment.dotenv) for key, value in ours.get("environment", {}).items()}
        assert environment == theirs.get("environment", {}), name
        for key in ("command", "entrypoint"):
            assert ours.get(key) == theirs.get(key), (name, key)
        if "healthcheck" in ours:  # as written: `docker-compose config` keeps the escaped $$ of a CMD-SHELL
            assert ours["healthcheck"]["test"] == theirs["healthcheck"]["test"], name


def test_interpolation_is_docker_composes() -> None:
    from airflow_tpu_posttrain.local.deployment import interpolate

    variables = {"SET": "value", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d}", variables) == "value d d"
    assert interpolate("${SET-d} ${EMPTY-d} ${UNSET-d}", variables) == "value  d"
    assert interpolate("${SET}/${UNSET} $${HOSTNAME}", variables) == "value/ ${HOSTNAME}"


def test_the_cli_service_runs_only_when_asked(config: dict[str, Any]) -> None:
    """As the official file's ``airflow-cli``: the common image and environment, started by its profile only."""
    cli, scheduler = config["services"]["airflow-cli"], config["services"]["airflow-scheduler"]
    assert cli["profiles"] == ["debug"] and cli["image"] == scheduler["image"]
    assert {k: v for k, v in cli["environment"].items() if k != "CONNECTION_CHECK_MAX_COUNT"} == scheduler["environment"]
