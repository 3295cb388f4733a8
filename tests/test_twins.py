"""A local twin runs its cloud entry's commands, differing by exactly ``recipes/runtime.LOCAL_DIFFERENCES``.

Rendered by the same DAG factory and operators, no more and no fewer differences. Both DAGs are parsed from dags/models.yaml; each MaxText task builds its job as a run would (``run_spec`` and
``build_job``), and the MaxText command is read back from the job's script.
"""

from __future__ import annotations

import copy
import shlex
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from airflow_tpu_posttrain.recipes.accelerators import accelerator
from airflow_tpu_posttrain.recipes.models import CLOUD_MODELS, LOCAL_HUB_SOURCES, MODELS, twin_key
from airflow_tpu_posttrain.recipes.runtime import LOCAL_DIFFERENCES, Step

# cloud DAG, its twin's DAG, the recipe's MaxText tasks
PAIRS = (
    ("posttrain_sft__gemma3-4b", "posttrain_sft__tiny-gemma3-4b", ("convert_to_maxtext", "train", "export_and_publish")),
    (
        "posttrain_rl__llama3.1-8b-Instruct",
        "posttrain_rl__tiny-llama3.1-8b-Instruct",
        ("convert_to_maxtext", "train", "export_and_publish"),
    ),
    (
        "posttrain_sft__gemma3-4b__slice",
        "posttrain_sft__tiny-gemma3-4b__slice",
        ("convert_to_maxtext", "train", "export_and_publish"),
    ),
    (
        "posttrain_sft__gemma3-4b__lora",
        "posttrain_sft__tiny-gemma3-4b__lora",
        ("convert_to_maxtext", "train", "export_and_publish"),
    ),
)
LOCAL_SLICE_VMS = 2  # the local stack's slices: 2 VMs standing for v6e-16's 4 (local/stack.py)
LOGICAL_DATE = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _deployment(configured_deployment):
    """The commands are rendered outside a task process."""


@pytest.fixture(scope="module")
def dags(tmp_path_factory):
    from airflow.dag_processing.dagbag import DagBag

    from tests.test_dags import DAGS_DIR

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPU_POSTTRAIN_LOCAL_DIR", str(tmp_path_factory.mktemp("local")))
        mp.delenv("TPU_POSTTRAIN_VM_DIR", raising=False)
        # The Hub connections the exports read their endpoint from: huggingface.co's, and the local Hub's.
        mp.setenv("AIRFLOW_CONN_HF_DEFAULT", '{"conn_type": "tpu_posttrain_huggingface"}')
        mp.setenv("AIRFLOW_CONN_LOCAL_HUB", '{"conn_type": "tpu_posttrain_huggingface", "host": "http://127.0.0.1:8"}')
        bag = DagBag(dag_folder=str(DAGS_DIR))
        assert not bag.import_errors, bag.import_errors
        yield bag.dags


class _VmRecords:
    """XCom as a run's steps would read it: the VM records (the machine a step runs on) and the trained checkpoint."""

    def __init__(self, dag, params: dict) -> None:
        self.dag, self.params = dag, params

    def xcom_pull(self, task_ids=None, *args, **kwargs):
        if task_ids == "train":  # the same trained checkpoint in both worlds: the export's own arguments compared
            return {"checkpoint": "/dev/shm/trained/checkpoints/5/model_params"}
        if task_ids not in ("create_cpu_vm", "create_export_vm", "create_tpu_vm"):
            return None
        machine = self.dag.get_task(task_ids).accelerator_type
        record = {"accelerator_type": self.params["accelerator_type"] if "{{" in machine else machine}
        acc = accelerator(record["accelerator_type"])
        if acc.is_multi_host:  # a slice's create records its VMs; each trains told every VM's address
            count = LOCAL_SLICE_VMS if "tiny" in self.dag.dag_id else acc.vms
            record["vms"] = [
                {"worker_id": i, "internal_ip": f"10.0.0.{i + 2}", "ssh_address": f"10.0.0.{i + 2}", "host_keys": {}}
                for i in range(count)
            ]
        return record


def _command(dag, task_id: str) -> dict:
    """The MaxText command a task's job runs: entry point, arguments (in order), environment and venv."""
    task = copy.deepcopy(dag.get_task(task_id))
    run_id = f"scheduled__{LOGICAL_DATE.isoformat()}"
    context = {
        "dag": dag,
        "run_id": run_id,
        "dag_run": SimpleNamespace(dag_id=dag.dag_id, run_id=run_id, logical_date=LOGICAL_DATE, conf={}),
        "params": dag.params.dump(),  # the trigger form's defaults: the registry entry's values
    }
    context["ti"] = _VmRecords(dag, context["params"])
    task.render_template_fields(context)
    spec = task.run_spec(context, "conversion-key")
    script = task._job(spec, context).script  # on a slice: worker 0's
    # The command's own block (RemoteCommand.script): `source <venv>/bin/activate`, its exports, `exec <argv>`.
    lines = script.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("exec ") and _is_maxtext(line)), None)
    assert end is not None, f"no MaxText command in {task_id}'s job:\n{script}"
    argv, env, venv = shlex.split(lines[end])[1:], {}, None
    for line in reversed(lines[:end]):
        words = shlex.split(line)
        if words[0] == "export":
            name, value = words[1].split("=", 1)
            env[name] = value
            continue
        if words[0] == "source":
            venv = words[1].removesuffix("/bin/activate")
        break
    split = next(i for i, word in enumerate(argv) if "=" in word)
    entry, args = tuple(argv[:split]), dict(word.split("=", 1) for word in argv[split:])
    return {"spec": spec, "entry": entry, "args": args, "env": env, "venv": venv}


def _steps_in(text: str) -> list[Step]:
    """The MaxText steps ``text`` starts: by module (``-m maxtext...``) or by its launcher (``<name>_cpu.py``)."""
    return [step for step in Step if step.value in text or f"/{step.value.rsplit('.', 1)[1]}_cpu.py" in text]


def _is_maxtext(line: str) -> bool:
    return bool(_steps_in(line))


def _step(command: dict) -> Step:
    (step,) = _steps_in(" ".join(command["entry"]))
    return step


def _same_place(value: str, twin: dict, cloud: dict) -> str:
    """A twin's path as the cloud run would name it: its run name, model key, storage and venv are the cloud's."""
    t, c = twin["spec"], cloud["spec"]
    for mine, theirs in (
        (t.layout.run_name, c.layout.run_name),
        (t.layout.storage, c.layout.storage),
        (t.layout.root, c.layout.root),
        (t.model.key, c.model.key),
    ):
        value = value.replace(mine, theirs) if mine else value
    return value


def differences(cloud: dict, twin: dict) -> set[str]:
    found = set()
    if cloud["entry"] != twin["entry"]:
        found.add("entry point")
    if cloud["venv"] != twin["venv"]:
        found.add("venv")
    if cloud["env"] != twin["env"]:
        found.add("env")
    for key in cloud["args"].keys() | twin["args"].keys():
        theirs, mine = cloud["args"].get(key), twin["args"].get(key)
        if mine is None or theirs != _same_place(mine, twin, cloud):
            found.add(f"argv {key}")
    return found


@pytest.mark.parametrize(("cloud_dag", "twin_dag", "task_ids"), PAIRS, ids=["sft", "rl", "sft-slice", "sft-lora"])
def test_a_twin_runs_its_cloud_entrys_commands_but_for_the_declared_differences(dags, cloud_dag, twin_dag, task_ids):
    for task_id in task_ids:
        cloud, twin = _command(dags[cloud_dag], task_id), _command(dags[twin_dag], task_id)
        step = _step(cloud)
        assert _step(twin) is step
        declared = {d.item for d in LOCAL_DIFFERENCES if step in d.steps}
        found = differences(cloud, twin)
        assert found <= declared, f"{twin_dag}.{task_id}: undeclared differences {sorted(found - declared)}"
        # Declared for the step and absent here: only what this recipe's model or data does not have.
        unused = declared - found
        allowed_unused = {"argv sliding_window_size"} if "llama" in cloud_dag else set()
        # A slice's processes join through jax.distributed, which the twin's CPU path then does not skip.
        allowed_unused |= {"argv skip_jax_distributed_system"} if cloud_dag.endswith("__slice") else set()
        # Only a LoRA training runs with bfloat16 weights on the CPU; LoRA's release (0.2.5) converts on 16 devices.
        lora = cloud_dag.endswith("__lora")
        allowed_unused |= {"argv --simulated_cpu_devices_count"} if lora else {"argv weight_dtype"}
        assert unused <= allowed_unused, f"{twin_dag}.{task_id}: declared but not different {sorted(unused)}"
        # Same model, same Hub repo, same release: only the shape is the twin's.
        assert twin["args"]["model_name"] == cloud["args"]["model_name"]
        assert twin["spec"].model.hf_source == cloud["spec"].model.hf_source
        assert twin["spec"].model.maxtext_version == cloud["spec"].model.maxtext_version


def test_every_declared_difference_is_used_by_a_twin(dags):
    used = set()
    for cloud_dag, twin_dag, task_ids in PAIRS:
        for task_id in task_ids:
            cloud, twin = _command(dags[cloud_dag], task_id), _command(dags[twin_dag], task_id)
            used |= {(item, _step(cloud)) for item in differences(cloud, twin)}
    for difference in LOCAL_DIFFERENCES:
        assert difference.reason
        for step in difference.steps:
            assert (difference.item, step) in used, f"{difference.item} at {step.name} differs in no twin"


def test_every_cloud_model_has_a_twin_served_under_its_repo_id():
    for key, cloud in CLOUD_MODELS.items():
        twin = MODELS[twin_key(key)]
        assert (twin.twin_of, twin.hf_source, twin.maxtext_model_name, twin.maxtext_version) == (
            key, cloud.hf_source, cloud.maxtext_model_name, cloud.maxtext_version
        )
        assert twin.hf_source in LOCAL_HUB_SOURCES


@pytest.mark.parametrize("dag_id", sorted({dag_id for pair in PAIRS for dag_id in pair[:2]} | {
    "posttrain_sft__tiny-llama", "posttrain_rl__tiny-llama"}))
def test_every_key_a_training_command_sets_is_one_its_release_defines(dags, dag_id):
    """The key lists the inputs check refuses unknown overrides by are those of the trainer's own config class.

    Each key the pipeline itself sets on a training command (the tutorial's, the model's, the runtime's) is in the
    list of the DAG's release and recipe (recipes/maxtext_config.py): a list from the wrong class, or from the
    wrong release, would refuse what MaxText accepts."""
    from airflow_tpu_posttrain.recipes import maxtext_config

    command = _command(dags[dag_id], "train")
    recipe = "rl" if _step(command) is Step.TRAIN_RL else "sft"
    release = dags[dag_id].params.dump()["maxtext_version"] or command["spec"].model.maxtext_version
    known = maxtext_config.known_keys(release, recipe)
    assert known is not None, release
    assert sorted(set(command["args"]) - known) == []


def test_a_nested_override_is_checked_against_its_releases_nested_keys():
    from airflow_tpu_posttrain.recipes import maxtext_config
    from airflow_tpu_posttrain.recipes.validation import SpecError

    assert maxtext_config.check_override_keys("overrides", ["rl.num_generations=4"], "0.2.3", "rl")
    with pytest.raises(SpecError, match=r"overrides\[0\].*'rl.num_generation'.*\(closest: rl.num_generations"):
        maxtext_config.check_override_keys("overrides", ["rl.num_generation=4"], "0.2.3", "rl")


def test_the_inputs_check_refuses_lora_in_a_full_model_recipe(dags):
    """MaxText defines lora.*, but a LoRA run saves its adapter only: the full-model export would publish the base."""
    from airflow_tpu_posttrain.exceptions import InvalidInputError

    task = copy.deepcopy(dags["posttrain_sft__tiny-llama"].get_task("check_inputs"))
    task.model, task.settings = "tiny-llama", {"overrides": ["lora.enable_lora=true"]}
    with pytest.raises(InvalidInputError, match=r"overrides\[0\]='lora.enable_lora=true': turns on LoRA"):
        task.execute({"dag_run": SimpleNamespace(dag_id="d", run_id="r", logical_date=LOGICAL_DATE)})


def test_every_release_a_model_pins_has_its_trainers_keys():
    from airflow_tpu_posttrain.recipes import maxtext_config

    for profile in MODELS.values():
        for recipe in ("sft", "rl"):
            keys = maxtext_config.known_keys(profile.maxtext_version, recipe)
            assert keys and {"steps", "learning_rate", "per_device_batch_size"} <= keys, (profile.key, recipe)
