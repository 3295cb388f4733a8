"""What Airflow learns of the provider (``get_provider_info``) is what the wheel ships."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import tomllib
from pathlib import Path

from airflow.sdk import BaseHook, BaseOperator
from airflow.triggers.base import BaseTrigger

import airflow_tpu_posttrain
from airflow_tpu_posttrain.get_provider_info import get_provider_info

REPO = Path(__file__).resolve().parents[1]
KINDS = {"hooks": BaseHook, "operators": BaseOperator, "triggers": BaseTrigger}


def _declared(kind: str) -> set[str]:
    return {module for entry in get_provider_info()[kind] for module in entry["python-modules"]}


def _defining(kind: str) -> set[str]:
    """The modules of ``airflow_tpu_posttrain.<kind>`` that define a hook, operator or trigger class."""
    package = importlib.import_module(f"airflow_tpu_posttrain.{kind}")
    found = set()
    for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
        module = importlib.import_module(info.name)
        if any(
            issubclass(cls, KINDS[kind]) and cls.__module__ == module.__name__
            for _, cls in inspect.getmembers(module, inspect.isclass)
        ):
            found.add(info.name)
    return found


def test_every_hook_operator_and_trigger_module_is_declared():
    for kind in KINDS:
        assert _declared(kind) == _defining(kind), kind
    declared_links = set(get_provider_info()["extra-links"])
    for link in declared_links:
        module, name = link.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), name), link
    for module in _defining("operators"):
        for _, operator in inspect.getmembers(importlib.import_module(module), inspect.isclass):
            for link in getattr(operator, "operator_extra_links", ()):
                assert f"{type(link).__module__}.{type(link).__name__}" in declared_links, (operator, link)


def test_the_google_connection_is_templated_where_googles_operators_template_it():
    from airflow_tpu_posttrain.operators.reaper import TpuVmReaperOperator
    from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
    from airflow_tpu_posttrain.operators.tpu_slice import TpuSliceCreateOperator, TpuSliceDeleteOperator
    from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

    operators = (TpuVmCreateOperator, TpuDeleteOperator, TpuVmReaperOperator, TpuSliceCreateOperator,
                 TpuSliceDeleteOperator)
    for operator in operators:
        assert {"gcp_conn_id", "impersonation_chain"} <= set(operator.template_fields), operator


def test_the_version_is_written_once():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert get_provider_info()["versions"] == [airflow_tpu_posttrain.__version__]


def test_the_hub_connection_type_labels_its_fields_and_gives_the_client(monkeypatch):
    import json

    from airflow.providers_manager import ProvidersManager

    from airflow_tpu_posttrain.hooks.hub import HuggingFaceHubHook

    manager = ProvidersManager()
    [declared] = get_provider_info()["connection-types"]
    assert declared["hook-class-name"] == "airflow_tpu_posttrain.hooks.hub.HuggingFaceHubHook"
    behaviour = manager.field_behaviours["tpu_posttrain_huggingface"]  # what the UI's form takes
    assert behaviour["relabeling"] == {"password": "Token", "host": "Hub endpoint"}
    declared_behaviour = {k.replace("-", "_"): v for k, v in declared["ui-field-behaviour"].items()}
    assert declared_behaviour == HuggingFaceHubHook.get_ui_field_behaviour()  # one behaviour, said twice
    connection = {"conn_type": "tpu_posttrain_huggingface", "host": "http://127.0.0.1:9", "password": "hf-test-not-a-token"}
    monkeypatch.setenv("AIRFLOW_CONN_MY_HUB", json.dumps(connection))
    api = HuggingFaceHubHook("my_hub").get_conn()
    assert (api.endpoint, api.token) == ("http://127.0.0.1:9", "hf-test-not-a-token")
    anonymous = HuggingFaceHubHook(None).get_conn()
    assert anonymous.token is None and anonymous.endpoint == "https://huggingface.co"


def _imports_between_modules() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at its top or inside a function (the wheel's modules only)."""
    import ast

    package_dir = Path(airflow_tpu_posttrain.__file__).parent
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if "local" not in parts and "example_dags" not in parts:
            modules[".".join(parts).removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def test_no_module_imports_itself_round_a_cycle():
    """A cycle hidden by an import inside a function is still a cycle: each module's dependencies come first."""
    graph = _imports_between_modules()
    state: dict[str, str] = {}
    path: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(" -> ".join([*path[path.index(imported):], imported]))
            elif imported not in state:
                visit(imported)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert len(graph) > 40, sorted(graph)  # the walk found the package's modules
    assert not cycles, "import cycles, each module importing the next:\n" + "\n".join(cycles)


def test_every_option_the_package_reads_is_declared_in_the_provider_config():
    """Airflow lists a provider's declared options (``airflow config list``); an undeclared one is invisible."""
    import ast

    package_dir = Path(airflow_tpu_posttrain.__file__).parent
    read = set()
    for path in package_dir.rglob("*.py"):
        if "local" in path.relative_to(package_dir).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "conf"):
                section, option = (arg.value for arg in node.args[:2])
                read.add((section, option))
    declared = {
        (section, option)
        for section, body in get_provider_info()["config"].items()
        for option in body["options"]
    }
    assert read and read <= declared, read - declared
    from airflow.providers_manager import ProvidersManager

    [ours] = [config for name, config in ProvidersManager().provider_configs if name == "airflow-tpu-posttrain"]
    assert {(section, option) for section, body in ours.items() for option in body["options"]} == declared


def test_every_public_operator_comes_from_the_operators_package():
    """What a DAG author wires by hand: every operator class of the operators' modules, by its name."""
    import airflow_tpu_posttrain.operators as operators

    defined = {
        name
        for module in pkgutil.iter_modules(operators.__path__)
        for name, cls in inspect.getmembers(importlib.import_module(f"{operators.__name__}.{module.name}"), inspect.isclass)
        if issubclass(cls, BaseOperator) and cls.__module__.startswith(operators.__name__)
        and not name.startswith("_") and not inspect.isabstract(cls)
    }
    shared_bases = {"ComputeOperator", "MaxTextJobOperator", "VmShapeOperator"}  # the bases the operators share, not steps themselves
    assert set(operators.__all__) == defined - shared_bases
    for name in operators.__all__:
        assert getattr(operators, name).__name__ == name
