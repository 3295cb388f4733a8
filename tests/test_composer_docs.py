"""docs/composer.md's promises about Google Cloud, checked against the code that relies on them.

- Roles: the IAM condition on Airflow's account grants read and write on exactly the objects the code reads and
  writes back in the checkpoint bucket (the lines of places under the TPU cap and the claims on a run's inputs),
  their names derived from the code with the page's own models.yaml, and not on what the VMs write there.
- Secret Manager: the backend configured as the page configures it is never asked for a Variable the code reads
  or writes (names Secret Manager refuses), and asks for connections under ids it accepts. Secret Manager is
  stood in for by a client that answers as Google documents: InvalidArgument for an id that is not 1-255 letters,
  digits, ``-`` or ``_``, NotFound for a valid id it does not hold.
- The deployment id: the page sets ``[tpu_posttrain] deployment_id`` to a valid id, and the code then uses it
  without reading or drawing the Variable.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "composer.md"
PACKAGE = REPO / "airflow_tpu_posttrain"
# Google's rule for a secret id (CreateSecretRequest.secret_id): at most 255 letters, digits, '-' and '_'.
SECRET_ID = re.compile(r"[A-Za-z0-9_-]{1,255}")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.S)


def _commands() -> list[list[str]]:
    """The page's shell commands, continuation lines joined and its exported variables substituted."""
    exports: dict[str, str] = {}
    commands = []
    for block in _blocks("bash"):
        heredoc = None
        for line in block.replace("\\\n", " ").splitlines():
            if heredoc is not None:  # a here-document's body is data, not commands
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            if found := re.search(r"<<'?(\w+)'?", line):
                heredoc = found.group(1)
            line = line.split("   #")[0].strip()
            if not line or line.startswith("#"):
                continue
            found = re.fullmatch(r"export (\w+)=(\S+)(?:\s+#.*)?", line)
            if found and "$(" not in found.group(2):
                value = re.sub(r"\$(\w+)", lambda m: exports.get(m.group(1), m.group(0)), found.group(2))
                exports[found.group(1)] = value
                continue
            line = re.sub(r"\$(\w+)", lambda m: exports.get(m.group(1), m.group(0)), line)
            try:
                commands.append(shlex.split(line, comments=True))
            except ValueError:  # a line of a multi-line quoted argument (step 8's python3 -c)
                continue
    return commands


def _command(*prefix: str) -> list[list[str]]:
    return [words for words in _commands() if words[: len(prefix)] == list(prefix)]


def _flag(words: list[str], name: str) -> str | None:
    values = [word.split("=", 1)[1] for word in words if word.startswith(f"--{name}=")]
    return values[0] if values else None


def _models_yaml() -> dict:
    [registry] = [yaml.safe_load(block) for block in _blocks("yaml") if "pipelines:" in block]
    return registry


def _example_dag_ids() -> list[str]:
    from airflow_tpu_posttrain.pipelines.registry import load_registry

    return [config.dag_id for config in load_registry(PACKAGE / "example_dags" / "models.yaml", local=False)]


# ---------------------------------------------------------------------------------------------------------- roles


def _object_condition(member: str, role: str, bucket: str) -> list[str]:
    """The object-name prefixes a conditional grant of ``role`` to ``member`` on ``bucket`` names.

    Only a disjunction of ``resource.name.startsWith("...")`` is read, so what it grants is exactly these."""
    [grant] = [
        words for words in _command("gcloud", "storage", "buckets", "add-iam-policy-binding", f"gs://{bucket}")
        if _flag(words, "member") == member and _flag(words, "role") == role
    ]
    fields = dict(part.split("=", 1) for part in _flag(grant, "condition").split(","))
    clause = r'resource\.name\.startsWith\("([^"]+)"\)'
    assert re.fullmatch(rf"{clause}(?: \|\| {clause})*", fields["expression"]), fields["expression"]
    prefixes = re.findall(clause, fields["expression"])
    names = [prefix.removeprefix(f"projects/_/buckets/{bucket}/objects/") for prefix in prefixes]
    assert all(prefix.startswith(f"projects/_/buckets/{bucket}/objects/") for prefix in prefixes), prefixes
    return names


def _granted(prefixes: list[str], uri: str, bucket: str) -> bool:
    assert uri.startswith(f"gs://{bucket}/"), uri
    return any(uri.removeprefix(f"gs://{bucket}/").startswith(prefix) for prefix in prefixes)


def test_airflows_account_may_write_the_places_and_claims_the_code_writes_and_nothing_else_in_the_bucket():
    from airflow_tpu_posttrain.pipelines.registry import places_location
    from airflow_tpu_posttrain.recipes import places, trainings

    defaults = _models_yaml()["defaults"]
    storage_at = defaults["checkpoint_storage"]
    bucket = storage_at.removeprefix("gs://").split("/")[0]
    env_sa = next(value for words in _commands() for value in [_flag(words, "service-account")] if value)

    granted = _object_condition(f"serviceAccount:{env_sa}", "roles/storage.objectUser", bucket)
    line = places.line_uri(places_location(defaults.get("capacity_claims"), storage_at), "us-east5-b-ct6e")
    for dag_id in _example_dag_ids():
        claim = trainings.claim_uri(storage_at, "posttrain", dag_id, {"dataset": "HuggingFaceH4/ultrachat_200k"})
        assert _granted(granted, claim, bucket), (claim, granted)
    assert _granted(granted, line, bucket), (line, granted)
    # Not the checkpoint storage the VMs write (checkpoints, exports), nor the bucket's other objects.
    assert not _granted(granted, f"{storage_at}/posttrain_sft__gemma3-4b/checkpoints/0/items", bucket)
    assert not _granted(granted, f"gs://{bucket}/anything-else.json", bucket)

    # Listing the lines (the reaper) and looking the bucket up (check_inputs) are granted on the bucket.
    readers = [
        words for words in _command("gcloud", "storage", "buckets", "add-iam-policy-binding", f"gs://{bucket}")
        if _flag(words, "member") == f"serviceAccount:{env_sa}"
        and _flag(words, "role") == "roles/storage.legacyBucketReader" and _flag(words, "condition") is None
    ]
    assert readers
    # IAM Conditions on a bucket need uniform bucket-level access: the page creates the bucket with it.
    [created] = _command("gcloud", "storage", "buckets", "create", f"gs://{bucket}")
    assert "--uniform-bucket-level-access" in created

    # The page's roles table names the same prefixes.
    [row] = [line for line in PAGE.read_text().splitlines() if line.startswith("| environment's | roles/storage.objectUser")]
    for prefix in granted:
        assert f"`{prefix}`" in row, (prefix, row)


def test_the_readme_roles_table_grants_airflows_connection_the_objects_under_the_prefixes_the_code_writes():
    from airflow_tpu_posttrain.pipelines.registry import places_location
    from airflow_tpu_posttrain.recipes import trainings

    storage_at = "gs://bucket/some/prefix"
    default_places = places_location(None, storage_at).removeprefix("gs://bucket/")
    claims_under = trainings.claim_uri(storage_at, "d", "dag", {}).removeprefix(f"{storage_at}/").split("/")[0]
    rows = [line for line in (REPO / "docs" / "google-cloud.md").read_text().splitlines() if "roles/storage.objectUser" in line]
    [row] = [row for row in rows if "the same |" in row or "Airflow's Google connection |" in row]
    assert "`<capacity_claims>/`" in row and f"`{default_places}/`" in row, row
    assert f"`<checkpoint_storage>/{claims_under}/`" in row, row
    assert "IAM condition" in row and "docs/composer.md" in row


# --------------------------------------------------------------------------------------------------- Secret Manager


def _airflow_configs() -> dict[tuple[str, str], str]:
    """The create command's ``--airflow-configs`` as {(section, key): value}; the update command sets the same."""
    [created] = _command("gcloud", "composer", "environments", "create")
    [updated] = [
        words for words in _command("gcloud", "composer", "environments", "update")
        if _flag(words, "update-airflow-configs")
    ]
    parsed = []
    for value in (_flag(created, "airflow-configs"), _flag(updated, "update-airflow-configs")):
        pairs = [pair.split("=", 1) for pair in value.split(",")]  # gcloud's KEY=VALUE,... (no value has a comma)
        parsed.append({tuple(key.split("-", 1)): value for key, value in pairs})
    assert parsed[0] == parsed[1]
    return parsed[0]


def _variables_the_code_uses() -> set[str]:
    """Every name the package passes to ``Variable.get``/``Variable.set``, for each example DAG."""
    names: set[str] = set()
    dag_ids = _example_dag_ids()
    for path in PACKAGE.rglob("*.py"):
        if "local" in path.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(path.read_text())
        calls = [
            node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "Variable"
            and node.func.attr in ("get", "set")
        ]
        if not calls:
            continue
        module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
        for call in calls:
            expression = compile(ast.Expression(call.args[0]), str(path), "eval")
            for dag_id in dag_ids:
                names.add(eval(expression, vars(module), {"dag_id": dag_id, "dag_run": SimpleNamespace(dag_id=dag_id)}))
    return names


class _SecretManagerStandIn:
    """Answers access_secret_version as Secret Manager does, and records the secret ids asked for."""

    def __init__(self):
        self.asked: list[str] = []
        self.errors: list[str] = []  # what the provider's client logs at ERROR

    def error(self, message, *args):
        self.errors.append(message % args)

    def debug(self, message, *args):
        pass

    def secret_version_path(self, project, secret, version):
        return f"projects/{project}/secrets/{secret}/versions/{version}"

    def access_secret_version(self, request):
        from google.api_core.exceptions import InvalidArgument, NotFound

        secret = request["name"].split("/")[3]
        self.asked.append(secret)
        if not SECRET_ID.fullmatch(secret):
            raise InvalidArgument(f"Invalid secret id {secret}")
        raise NotFound(f"Secret {secret} not found")


@pytest.fixture
def secret_manager(monkeypatch):
    from airflow.providers.google.cloud._internal_client import secret_manager_client
    from airflow.providers.google.cloud.secrets import secret_manager
    from google.auth.credentials import AnonymousCredentials

    stand_in = _SecretManagerStandIn()
    monkeypatch.setattr(secret_manager_client._SecretManagerClient, "client", property(lambda self: stand_in))
    monkeypatch.setattr(secret_manager_client._SecretManagerClient, "log", property(lambda self: stand_in))
    monkeypatch.setattr(
        secret_manager, "get_credentials_and_project_id", lambda **kwargs: (AnonymousCredentials(), "my-project")
    )
    return stand_in


def _backend(configs: dict[tuple[str, str], str], **override):
    module, _, name = configs[("secrets", "backend")].rpartition(".")
    backend_class = getattr(importlib.import_module(module), name)
    return backend_class(**{**json.loads(configs[("secrets", "backend_kwargs")]), **override})


def test_the_pages_secret_manager_backend_asks_for_no_variable_and_only_valid_connection_ids(secret_manager):
    from airflow_tpu_posttrain.defaults import GCP_CONN_ID, HF_CONN_ID, SSH_CONN_ID

    configs = _airflow_configs()
    backend = _backend(configs)
    variables = _variables_the_code_uses()
    assert {"airflow_tpu_posttrain.deployment_id", "airflow_tpu_posttrain.timings"} <= variables
    page = PAGE.read_text()
    dag_ids = _example_dag_ids()
    for name in variables:  # the page names each Variable the backend is kept away from
        named = {name, *(name.replace(dag_id, "<dag_id>") for dag_id in dag_ids if name.endswith(f".{dag_id}"))}
        assert any(f"`{form}`" in page for form in named), name
    for name in sorted(variables):
        assert backend.get_variable(name) is None
    assert secret_manager.asked == []  # not one request: the Variables are Airflow's database's alone

    for conn_id in (GCP_CONN_ID, SSH_CONN_ID, HF_CONN_ID):
        assert backend.get_conn_value(conn_id) is None
    # The page's secrets (step 8) are the ids asked for, and Secret Manager accepts each.
    assert secret_manager.asked == [f"airflow-connections-{conn_id}" for conn_id in (GCP_CONN_ID, SSH_CONN_ID, HF_CONN_ID)]
    for secret in secret_manager.asked[1:]:
        assert SECRET_ID.fullmatch(secret) and f"gcloud secrets create {secret} " in page, secret
    assert secret_manager.errors == []


def test_with_the_backends_default_variables_prefix_each_variable_read_logs_an_error(secret_manager):
    """What the page's ``variables_prefix: null`` avoids, as the page says: the ids are refused, ERROR lines."""
    backend = _backend(_airflow_configs(), variables_prefix="airflow-variables")  # the backend's default
    variables = sorted(_variables_the_code_uses())
    for name in variables:
        assert backend.get_variable(name) is None  # Airflow then reads its database
    assert secret_manager.asked == [f"airflow-variables-{name}" for name in variables]
    assert not any(SECRET_ID.fullmatch(secret) for secret in secret_manager.asked)
    errors = secret_manager.errors
    assert len(errors) == len(variables) and all("InvalidArgument" in error for error in errors), errors


# ---------------------------------------------------------------------------------------------------- deployment


def test_the_page_sets_a_valid_deployment_id_and_the_code_uses_it_without_the_variable(monkeypatch):
    from airflow.sdk import Variable

    from airflow_tpu_posttrain.get_provider_info import get_provider_info
    from airflow_tpu_posttrain.operators import compute_base
    from airflow_tpu_posttrain.recipes import validation

    configs = _airflow_configs()
    section, key = "tpu_posttrain", "deployment_id"
    assert key in get_provider_info()["config"][section]["options"]  # the option the provider declares
    configured = configs[(section, key)]
    assert validation.gce_name(f"[{section}] {key}", configured) == configured

    def no_variable(*args, **kwargs):
        raise AssertionError("the Variable is neither read nor drawn when the id is configured")

    monkeypatch.setattr(Variable, "get", no_variable)
    monkeypatch.setattr(Variable, "set", no_variable)
    monkeypatch.setenv(f"AIRFLOW__{section.upper()}__{key.upper()}", configured)  # what Composer's override sets
    assert compute_base.deployment_id() == configured
