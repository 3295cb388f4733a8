"""The recipe layer against the two tutorials (shared/reference/seed-workflows.md) and hostile input."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import shlex
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from airflow_tpu_posttrain.recipes import install, maxtext
from airflow_tpu_posttrain.recipes.accelerators import ACCELERATORS, SLICE_ACCELERATORS, accelerator, tpu_env
from airflow_tpu_posttrain.recipes.layout import RunLayout, conversion_key, run_name
from airflow_tpu_posttrain.recipes.models import RlDataset, SftDataset, model_profile
from airflow_tpu_posttrain.recipes.runtime import cpu_runtime, tpu_runtime
from airflow_tpu_posttrain.recipes.shell import ShellExpansion
from airflow_tpu_posttrain.recipes.validation import SpecError

# The tutorials' RUN_NAME=$(date +%Y-%m-%d-%H-%M-%S), fixed.
SEED_RUN = "2026-01-05-10-00-00"

# The tutorials' commands, with their variables substituted by the values the tutorials give them
# (MODEL_CHECKPOINT_DIRECTORY=/dev/shm/$MODEL_NAME/mt-format/, USE_PATHWAYS=0, LAZY_LOAD_TENSORS=False,
# BASE_OUTPUT_DIRECTORY=/dev/shm/$MODEL_NAME/post-train/,
# MAXTEXT_CKPT_PATH=$MODEL_CHECKPOINT_DIRECTORY/0/items,
# HF_EXPORT=/dev/shm/$MODEL_NAME/hf-trained/$RUN_NAME/ (the seeds leave it to the user), STEPS=1000, NUM_BATCHES=50, CHIPS_PER_VM=8).
#
# The tutorials' POST_TRAIN_PATH: $BASE_OUTPUT_DIRECTORY/$RUN_NAME/checkpoints/$STEPS/model_params (SFT) and
# $BASE_OUTPUT_DIRECTORY/$RUN_NAME/checkpoints/actor/$NUM_BATCHES/model_params (RL).
SEED_SFT_POST_TRAIN_PATH = "/dev/shm/gemma3-4b/post-train//2026-01-05-10-00-00/checkpoints/1000/model_params"
SEED_RL_POST_TRAIN_PATH = (
    "/dev/shm/llama3.1-8b-Instruct/post-train//2026-01-05-10-00-00/checkpoints/actor/50/model_params"
)

SEED_SFT_TO_MAXTEXT = """python3 -m maxtext.checkpoint_conversion.to_maxtext \\
    model_name="gemma3-4b" \\
    hf_access_token="hf_EXAMPLE" \\
    base_output_directory="/dev/shm/gemma3-4b/mt-format/" \\
    scan_layers=True \\
    use_multimodal=False \\
    hardware=cpu \\
    skip_jax_distributed_system=true \\
    checkpoint_storage_use_zarr3=1 \\
    checkpoint_storage_use_ocdbt=1 \\
    --lazy_load_tensors="False"
"""
SEED_SFT_TRAIN = """python3 -m maxtext.trainers.post_train.sft.train_sft \\
       run_name="2026-01-05-10-00-00" \\
       base_output_directory="/dev/shm/gemma3-4b/post-train/" \\
       model_name="gemma3-4b" \\
       load_parameters_path="/dev/shm/gemma3-4b/mt-format//0/items" \\
       per_device_batch_size="1" \\
       steps="1000" \\
       hf_path="HuggingFaceH4/ultrachat_200k" \\
       train_split="train_sft" \\
       train_data_columns="['messages']" \\
       profiler=xplane
"""
SEED_SFT_TO_HUGGINGFACE = f"""python3 -m maxtext.checkpoint_conversion.to_huggingface \\
       model_name="gemma3-4b" \\
       load_parameters_path="{SEED_SFT_POST_TRAIN_PATH}" \\
       base_output_directory="/dev/shm/gemma3-4b/hf-trained/{SEED_RUN}/" \\
       scan_layers=True \\
       use_multimodal=False \\
       weight_dtype=bfloat16
"""
SEED_RL_TO_MAXTEXT = SEED_SFT_TO_MAXTEXT.replace("gemma3-4b", "llama3.1-8b-Instruct")
SEED_RL_TRAIN = """python3 -m maxtext.trainers.post_train.rl.train_rl \\
       model_name="llama3.1-8b-Instruct" \\
       load_parameters_path="/dev/shm/llama3.1-8b-Instruct/mt-format//0/items" \\
       run_name="2026-01-05-10-00-00" \\
       base_output_directory="/dev/shm/llama3.1-8b-Instruct/post-train/" \\
       chips_per_vm="8" \\
       num_batches="50" \\
       num_test_batches=10 \\
       rollout_data_parallelism=1 \\
       rollout_tensor_parallelism=-1
"""
SEED_RL_TO_HUGGINGFACE = f"""python3 -m maxtext.checkpoint_conversion.to_huggingface \\
       model_name="llama3.1-8b" \\
       load_parameters_path="{SEED_RL_POST_TRAIN_PATH}" \\
       base_output_directory="/dev/shm/llama3.1-8b-Instruct/hf-trained/{SEED_RUN}/" \\
       scan_layers=True \\
       use_multimodal=False \\
       weight_dtype=bfloat16
"""
SEED_TRAINING_EXPORTS = """export TPU_ACCELERATOR_TYPE=v6e-8
export TPU_WORKER_ID=0
TPU_NAME=$(hostname)
export TPU_NAME
export TPU_SKIP_MDS_QUERY=1
export TPU_WORKER_HOSTNAMES=localhost
export TPU_TOPOLOGY=2x4
export TPU_CHIPS_PER_HOST_BOUNDS=2,4,1
export TPU_HOST_BOUNDS=1,1,1
"""

HOSTILE = ["a;b", "a && b", "a|b", "$(id)", "`id`", "a\nb", "a'b", 'a"b', "..", "../x", "a b"]


def _argv(command: str) -> list[str]:
    """A tutorial command as the shell passes it, with directory values written the one POSIX way.

    The tutorials' directories end in '/', so '$DIR/0/items' contains '//'; the recipes write
    '/dev/shm/x/mt-format' and '/dev/shm/x/mt-format/0/items'. Both name the same files; nothing else is
    normalised.
    """
    tokens = shlex.split(command.replace("\\\n", " "))
    return [_normalise_path_value(token) for token in tokens]


def _normalise_path_value(token: str) -> str:
    key, sep, value = token.partition("=")
    return f"{key}={posixpath.normpath(value)}" if sep and value.startswith("/") else token


def _without_token_argument(argv: list[str]) -> list[str]:
    """Deliberate deviation: the token stays out of argv (MaxText reads HF_TOKEN from the environment)."""
    return [token for token in argv if not token.startswith("hf_access_token=")]


def _seed_spec(model_key: str) -> maxtext.RunSpec:
    return maxtext.RunSpec(
        model=model_profile(model_key),
        accelerator=accelerator("v6e-8"),
        runtime=tpu_runtime(),
        layout=RunLayout(model_key, SEED_RUN),
    )


def _cpu_spec() -> maxtext.RunSpec:
    return maxtext.RunSpec(
        model=model_profile("tiny-llama"),
        accelerator=accelerator("cpu"),
        runtime=cpu_runtime("/opt/launchers", "/work/main/.local/maxtext-venv"),
        layout=RunLayout("tiny-llama", "tiny-run"),
    )


def _bash(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env, check=False
    )


# --- the tutorials, reproduced ------------------------------------------------------------------------------


def test_sft_seed_commands():
    spec = _seed_spec("gemma3-4b")
    assert list(maxtext.to_maxtext(spec).argv) == _without_token_argument(_argv(SEED_SFT_TO_MAXTEXT))
    sft = maxtext.train_sft(spec)
    # The tokenizer from the VM's copy of the base model's files, the dataset from its copy at the run's revision
    # (MaxText's input pipeline takes no revision): the trainer runs without the token.
    pipeline_extra = ["checkpoint_period=200", "tokenizer_path=/dev/shm/gemma3-4b/base-model-files"]
    seed = [
        "hf_path=/dev/shm/gemma3-4b/dataset" if arg == "hf_path=HuggingFaceH4/ultrachat_200k" else arg
        for arg in _argv(SEED_SFT_TRAIN)
    ]
    assert seed != _argv(SEED_SFT_TRAIN)
    assert list(sft.argv) == seed + pipeline_extra
    export = maxtext.to_huggingface(spec, spec.layout.sft_params(1000))
    assert list(export.argv) == _argv(SEED_SFT_TO_HUGGINGFACE)


def test_lora_adds_the_lora_tutorials_keys_and_exports_the_adapter_alone():
    """MaxText 0.2.4's LoRA tutorial: train_sft with lora.*, then to_huggingface from lora.lora_restore_path."""
    from airflow_tpu_posttrain.recipes.lora import LoraSettings

    spec = _seed_spec("gemma3-4b")
    settings = LoraSettings(rank=16, alpha=32, target_modules="decoder/.*self_attention/(query|value)", weight_qtype="nf4")
    sft = maxtext.train_sft(spec, lora=settings)
    assert list(sft.argv) == list(maxtext.train_sft(spec).argv) + [
        "lora.enable_lora=True", "lora.lora_rank=16", "lora.lora_alpha=32.0",
        "lora.lora_module_path=decoder/.*self_attention/(query|value)", "lora.lora_weight_qtype=nf4",
    ]
    assert "'lora.lora_module_path=decoder/.*self_attention/(query|value)'" in sft.script()  # one quoted word
    export = maxtext.to_huggingface(spec, spec.layout.sft_params(1000), lora=settings)
    assert list(export.argv) == [
        "python3", "-m", "maxtext.checkpoint_conversion.to_huggingface", "model_name=gemma3-4b",
        f"lora.lora_restore_path={spec.layout.sft_params(1000)}", "lora.lora_rank=16", "lora.lora_alpha=32.0",
        f"base_output_directory={spec.layout.export_dir}", "scan_layers=True", "use_multimodal=False",
    ]
    with pytest.raises(SpecError, match=r"overrides\[0\]='lora.lora_rank=8': overrides 'lora.lora_rank'"):
        maxtext.train_sft(spec, lora=settings, overrides=["lora.lora_rank=8"])


def test_rl_seed_commands():
    spec = _seed_spec("llama3.1-8b-Instruct")
    assert list(maxtext.to_maxtext(spec).argv) == _without_token_argument(_argv(SEED_RL_TO_MAXTEXT))
    # GSM8K's main subset from the VM's copy at the run's revision (the recipe would read the Hub's main).
    rl_extra = [
        "hf_train_files=/dev/shm/llama3.1-8b-Instruct/dataset/main/train-*.parquet",
        "hf_eval_files=/dev/shm/llama3.1-8b-Instruct/dataset/main/test-*.parquet",
        "tokenizer_path=/dev/shm/llama3.1-8b-Instruct/base-model-files",
    ]
    assert list(maxtext.train_rl(spec).argv) == _argv(SEED_RL_TRAIN) + rl_extra
    export = maxtext.to_huggingface(spec, spec.layout.rl_params(50))
    # Deliberate deviation: the trained model's name, so to_huggingface (0.2.3 knows it) takes the tokenizer
    # and chat template of meta-llama/Llama-3.1-8B-Instruct, not of the base model's separately gated repo.
    seed = _argv(SEED_RL_TO_HUGGINGFACE.replace('model_name="llama3.1-8b"', 'model_name="llama3.1-8b-Instruct"'))
    assert list(export.argv) == seed


def test_to_maxtext_converts_the_revision_it_is_given():
    spec = _seed_spec("gemma3-4b")
    sha = "0123456789abcdef0123456789abcdef01234567"
    command = maxtext.to_maxtext(spec, revision=sha)
    assert command.argv[-1] == f"--revision={sha}"
    assert command.argv[:-1] == maxtext.to_maxtext(spec).argv
    for hostile in ("main", "$(id)", sha[:-1], sha.upper()):
        with pytest.raises(SpecError) as err:
            maxtext.to_maxtext(spec, revision=hostile)
        assert err.value.field == "revision"


def test_training_env_is_the_seeds_exports():
    assert tpu_env(accelerator("v6e-8")) == {
        "TPU_ACCELERATOR_TYPE": "v6e-8",
        "TPU_WORKER_ID": "0",
        "TPU_NAME": ShellExpansion.HOSTNAME,
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_TOPOLOGY": "2x4",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
        "TPU_HOST_BOUNDS": "1,1,1",
    }
    spec = _seed_spec("gemma3-4b")
    for command in (maxtext.train_sft(spec), maxtext.train_rl(_seed_spec("llama3.1-8b-Instruct"))):
        assert command.env == tpu_env(accelerator("v6e-8"))
    # The conversion runs on the VM's CPU before the TPU environment is exported, as in the tutorials; the
    # export runs after training, in the shell that still holds it.
    assert maxtext.to_maxtext(spec).env == {}
    assert maxtext.to_huggingface(spec, spec.layout.sft_params(1000)).env == tpu_env(accelerator("v6e-8"))


def test_training_script_exports_what_the_seed_exports():
    """Both export blocks, run by bash, leave the same TPU_* variables (TPU_NAME being the host's name)."""
    show = '\nenv | grep "^TPU_" | sort'
    script = maxtext.train_sft(_seed_spec("gemma3-4b")).script()
    ours = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    seed_run, our_run = _bash(SEED_TRAINING_EXPORTS + show), _bash(ours + show)
    assert our_run.returncode == 0
    assert our_run.stdout == seed_run.stdout
    assert f"TPU_NAME={os.uname().nodename}" in our_run.stdout
    assert 'export TPU_NAME="$(hostname)"' in script.splitlines()


def test_checkpoint_paths_are_the_seeds_post_train_paths():
    sft, rl = RunLayout("gemma3-4b", SEED_RUN), RunLayout("llama3.1-8b-Instruct", SEED_RUN)
    assert sft.sft_params(1000) == posixpath.normpath(SEED_SFT_POST_TRAIN_PATH)
    assert rl.rl_params(50) == posixpath.normpath(SEED_RL_POST_TRAIN_PATH)
    assert sft.converted_params == "/dev/shm/gemma3-4b/mt-format/0/items"
    assert sft.export_dir == f"/dev/shm/gemma3-4b/hf-trained/{SEED_RUN}"
    assert RunLayout("gemma3-4b", SEED_RUN, root="/mnt/disk/").post_train_dir == "/mnt/disk/post-train"


@pytest.mark.parametrize(
    ("accelerator_type", "machine_type", "chips", "topology", "bounds"),
    [("v6e-1", "ct6e-standard-1t", 1, "1x1", "1,1,1"), ("v6e-4", "ct6e-standard-4t", 4, "2x2", "2,2,1")],
)
def test_smaller_v6e_slices(accelerator_type, machine_type, chips, topology, bounds):
    acc = accelerator(accelerator_type)
    assert (acc.machine_type, acc.chips, acc.topology, acc.chips_per_host_bounds) == (
        machine_type,
        chips,
        topology,
        bounds,
    )
    assert tpu_env(acc)["TPU_TOPOLOGY"] == topology
    assert (
        f"chips_per_vm={chips}"
        in maxtext.train_rl(
            maxtext.RunSpec(
                model_profile("llama3.1-8b-Instruct"),
                acc,
                tpu_runtime(),
                RunLayout("llama3.1-8b-Instruct", "r"),
            )
        ).argv
    )


def test_seed_scripts_activate_the_venv_and_exec():
    lines = maxtext.train_rl(_seed_spec("llama3.1-8b-Instruct")).script().splitlines()
    assert lines[:3] == [
        "#!/usr/bin/env bash",
        "set -euo pipefail",
        'source "$HOME"/maxtext_venv/bin/activate',
    ]
    assert lines[-1].startswith("exec python3 -m maxtext.trainers.post_train.rl.train_rl ")


# --- the cpu runtime ----------------------------------------------------------------------------------------


def test_the_twins_convert_on_one_simulated_cpu_device_where_their_release_saves_with_it():
    """MaxText 0.2.2 and 0.2.3 (the twins' releases): one device. 0.2.5 fails to save then: its default of 16."""
    from airflow_tpu_posttrain.operators.maxtext import MaxTextConvertOperator

    def flags(key: str, version: str | None = None, runtime=None) -> list[str]:
        model = model_profile(key)
        model = dataclasses.replace(model, maxtext_version=version) if version else model
        spec = maxtext.RunSpec(
            model=model,
            accelerator=accelerator("cpu"),
            runtime=runtime or cpu_runtime("/opt/launchers", "/work/main/.local/maxtext-venv"),
            layout=RunLayout(key, "tiny-run"),
        )
        return [arg for arg in maxtext.to_maxtext(spec).argv if arg.startswith("--simulated_cpu_devices_count")]

    assert flags("tiny-gemma3-4b") == flags("tiny-llama3.1-8b-Instruct") == ["--simulated_cpu_devices_count=1"]
    assert flags("tiny-llama") == flags("tiny-gemma3-4b", "0.2.5") == []  # 0.2.5
    assert flags("gemma3-4b", runtime=tpu_runtime()) == []  # the cloud conversion: MaxText's default
    # A run's maxtext_version is the release the conversion's arguments are for.
    convert = MaxTextConvertOperator(task_id="convert_to_maxtext", model="tiny-gemma3-4b", maxtext_version="0.2.5")
    assert convert._profile().maxtext_version == "0.2.5"
    assert MaxTextConvertOperator(task_id="c", model="tiny-gemma3-4b")._profile().maxtext_version == "0.2.2"


def test_cpu_runtime_commands():
    spec = _cpu_spec()
    model_dir = "local/tiny-llama"  # the tiny model's gated repo on the local Hub, read with the token
    dims = [f"{k}={v}" for k, v in spec.model.maxtext_overrides.items()]
    cpu = ["hardware=cpu", "skip_jax_distributed_system=true", "attention=dot_product"]

    convert = maxtext.to_maxtext(spec)
    assert convert.argv[:2] == ("python3", "/opt/launchers/to_maxtext_cpu.py")
    assert "--lazy_load_tensors=True" in convert.argv and "--lazy_load_tensors=False" not in convert.argv
    assert convert.argv.count("hardware=cpu") == 1  # the seed's value, kept in its place
    assert convert.argv[-1] == f"--hf_model_path={model_dir}"
    assert convert.env == {"JAX_PLATFORMS": "cpu"}

    sft = maxtext.train_sft(spec)
    assert sft.argv[:3] == ("python3", "-m", "maxtext.trainers.post_train.sft.train_sft")
    assert sft.argv[3:] == (
        "run_name=tiny-run",
        "base_output_directory=/dev/shm/tiny-llama/post-train",
        "model_name=llama3.1-8b",
        "load_parameters_path=/dev/shm/tiny-llama/mt-format/0/items",
        "per_device_batch_size=1",
        "steps=5",
        "hf_path=/dev/shm/tiny-llama/dataset",
        "train_split=train_sft",
        "train_data_columns=['messages']",
        "profiler=xplane",
        "checkpoint_period=200",
        "tokenizer_path=/dev/shm/tiny-llama/base-model-files",
        *dims,
        *cpu,
        "max_target_length=128",
    )
    assert sft.env == {"JAX_PLATFORMS": "cpu"}
    # With gs:// storage too: JAX's profiler writes its trace through TSL's GCS client, which a local VM sends
    # to the local GCS server's HTTPS front as Google's host (local/google_front.py).
    in_gcs = dataclasses.replace(spec, layout=RunLayout("tiny-llama", "tiny-run", storage="gs://bucket/p", conversion_key="k"))
    assert "profiler=xplane" in maxtext.train_sft(in_gcs).argv

    rl = maxtext.train_rl(spec)
    assert rl.argv[:2] == ("python3", "/opt/launchers/train_rl_cpu.py")
    assert rl.argv[2:] == (
        "model_name=llama3.1-8b",
        "load_parameters_path=/dev/shm/tiny-llama/mt-format/0/items",
        "run_name=tiny-run",
        "base_output_directory=/dev/shm/tiny-llama/post-train",
        "chips_per_vm=1",
        "num_batches=2",
        "num_test_batches=2",
        "rollout_data_parallelism=1",
        "rollout_tensor_parallelism=-1",
        "hf_train_files=/dev/shm/tiny-llama/dataset/main/train-*.parquet",
        "hf_eval_files=/dev/shm/tiny-llama/dataset/main/test-*.parquet",
        "tokenizer_path=/dev/shm/tiny-llama/base-model-files",
        *dims,
        "max_prefill_predict_length=128",
        "max_target_length=160",
    )

    export = maxtext.to_huggingface(spec, spec.layout.rl_params(2))
    assert export.argv[:2] == ("python3", "/opt/launchers/to_huggingface_cpu.py")
    assert export.argv[-2:] == ("--override_model_architecture=true", f"--hf_model_path={model_dir}")
    assert export.script().splitlines()[2] == "source /work/main/.local/maxtext-venv/bin/activate"


def test_runtime_refuses_mismatched_combinations():
    tiny_on_tpu = maxtext.RunSpec(
        model_profile("tiny-llama"), accelerator("v6e-8"), cpu_runtime("/l", "/v"), RunLayout("tiny-llama", "r")
    )
    with pytest.raises(SpecError) as err:
        maxtext.train_sft(tiny_on_tpu)
    assert err.value.field == "accelerator_type"
    gemma_on_cpu_vm = maxtext.RunSpec(
        model_profile("gemma3-4b"), accelerator("cpu-highmem-16"), tpu_runtime(), RunLayout("gemma3-4b", "r")
    )
    with pytest.raises(SpecError) as err:
        maxtext.train_sft(gemma_on_cpu_vm)
    assert err.value.field == "accelerator_type"
    with pytest.raises(SpecError) as err:
        maxtext.RunSpec(
            model_profile("gemma3-4b"),
            accelerator("cpu"),
            cpu_runtime("/l", "/v"),
            RunLayout("gemma3-4b", "r"),
        )
    assert err.value.field == "model"
    with pytest.raises(SpecError) as err:
        maxtext.RunSpec(
            model_profile("gemma3-4b"), accelerator("v6e-8"), tpu_runtime(), RunLayout("tiny-llama", "r")
        )
    assert err.value.field == "model"


def test_conversions_on_a_cpu_vm_are_the_seeds_commands_with_jax_on_the_cpu():
    """The split layout's CPU VM runs the tutorials' conversion and export (tpu runtime), JAX on its CPU."""
    on_tpu, on_cpu_vm = _seed_spec("gemma3-4b"), maxtext.RunSpec(
        model_profile("gemma3-4b"), accelerator("cpu-highmem-16"), tpu_runtime(), RunLayout("gemma3-4b", SEED_RUN)
    )
    assert maxtext.to_maxtext(on_cpu_vm).argv == maxtext.to_maxtext(on_tpu).argv
    assert maxtext.to_maxtext(on_tpu).env == {}
    assert maxtext.to_maxtext(on_cpu_vm).env == {"JAX_PLATFORMS": "cpu"}
    trained = on_tpu.layout.sft_params(1000)
    # The export on a CPU VM: MaxText's flags for a conversion on a CPU (convert_checkpoint.md), without which
    # its pyconfig calls jax.distributed.initialize() and fails off a TPU.
    on_cpu_export = maxtext.to_huggingface(on_cpu_vm, trained)
    assert on_cpu_export.argv == (
        *maxtext.to_huggingface(on_tpu, trained).argv, "hardware=cpu", "skip_jax_distributed_system=true"
    )
    assert on_cpu_export.env == {"JAX_PLATFORMS": "cpu"}
    assert accelerator("cpu-highmem-16").machine_type == "n2-highmem-16"


def test_split_layout_puts_checkpoints_in_storage_and_keys_the_conversion():
    storage = "gs://bucket/prefix/"
    keyed = RunLayout("gemma3-4b", "run-1", storage=storage, conversion_key="mt0.2.2-0123456789abcdef")
    assert keyed.converted_dir == "gs://bucket/prefix/conversions/gemma3-4b/mt0.2.2-0123456789abcdef"
    assert keyed.converted_params == f"{keyed.converted_dir}/0/items"
    assert keyed.sft_params(1000) == "gs://bucket/prefix/post-train/run-1/checkpoints/1000/model_params"
    assert keyed.export_dir == "/dev/shm/gemma3-4b/hf-trained/run-1"  # the export stays on the exporting VM
    with pytest.raises(SpecError) as err:
        _ = RunLayout("gemma3-4b", "run-1", storage=storage).converted_dir
    assert err.value.field == "conversion_key"
    assert RunLayout("m", "r", storage="file:///shared/ckpt").post_train_dir == "/shared/ckpt/post-train"
    for hostile in ("gs://bucket/$(id)", "relative/dir", "/a/../b", "gs://b/x;rm"):
        with pytest.raises(SpecError) as err:
            RunLayout("m", "r", storage=hostile)
        assert err.value.field == "checkpoint_storage"

    spec = maxtext.RunSpec(model_profile("gemma3-4b"), accelerator("v6e-8"), tpu_runtime(), keyed)
    command = maxtext.train_sft(spec, converted_params=keyed.converted_params)
    assert f"load_parameters_path={keyed.converted_params}" in command.argv
    assert "base_output_directory=gs://bucket/prefix/post-train" in command.argv
    assert f"load_parameters_path={keyed.sft_params(1000)}" in maxtext.to_huggingface(spec, keyed.sft_params(1000)).argv


def test_conversion_key_changes_with_what_determines_the_conversion():
    base = conversion_key("0.2.2", "abc123", ["model_name=gemma3-4b", "scan_layers=True"])
    assert base == conversion_key("0.2.2", "abc123", ["model_name=gemma3-4b", "scan_layers=True"])
    assert base.startswith("mt0.2.2-") and len(base) == len("mt0.2.2-") + 16
    others = {
        conversion_key("0.2.3", "abc123", ["model_name=gemma3-4b", "scan_layers=True"]),
        conversion_key("0.2.2", "def456", ["model_name=gemma3-4b", "scan_layers=True"]),
        conversion_key("0.2.2", "abc123", ["model_name=gemma3-4b", "scan_layers=False"]),
    }
    assert base not in others and len(others) == 3
    with pytest.raises(SpecError) as err:
        conversion_key("latest", "abc123", [])
    assert err.value.field == "maxtext_version"


def test_overrides_and_recipe_knobs():
    spec = _seed_spec("gemma3-4b")
    sft = maxtext.train_sft(
        spec,
        steps=20,
        checkpoint_period=10,
        profiler="",
        overrides=["learning_rate=1e-5", "weight_dtype=bfloat16"],
    )
    assert {"steps=20", "checkpoint_period=10"} <= set(sft.argv)
    # No profiler: no profiler argument (MaxText 0.2.5 reads "profiler=" as None and refuses it).
    assert not [arg for arg in sft.argv if arg.startswith("profiler=")]
    assert sft.argv[-2:] == ("learning_rate=1e-5", "weight_dtype=bfloat16")
    # A nested key, as MaxText's command line takes it (OmegaConf's dot list).
    rl = maxtext.train_rl(_seed_spec("llama3.1-8b-Instruct"), overrides=["rl.num_generations=4"])
    assert rl.argv[-1] == "rl.num_generations=4"
    data = SftDataset(
        hf_path="owner/chats", train_split="train", train_data_columns="['prompt', 'completion']"
    )
    assert "train_data_columns=['prompt', 'completion']" in maxtext.train_sft(spec, dataset=data).argv
    assert "num_batches=3" in maxtext.train_rl(_seed_spec("llama3.1-8b-Instruct"), num_batches=3).argv


# --- hostile and invalid input ------------------------------------------------------------------------------


def _field_of(call) -> str:
    with pytest.raises(SpecError) as err:
        call()
    return err.value.field


@pytest.mark.parametrize("value", [*HOSTILE, "/abs/name", ""])
def test_names_refuse_hostile_values(value):
    assert _field_of(lambda: RunLayout("gemma3-4b", value)) == "run_name"
    assert _field_of(lambda: model_profile(value)) == "model"
    assert _field_of(lambda: accelerator(value)) == "accelerator_type"
    assert _field_of(lambda: SftDataset(hf_path="owner/chats", train_split=value)) == "train_split"


@pytest.mark.parametrize("value", [*HOSTILE, "/abs/dataset", "", "json", "a/b/c"])
def test_dataset_id_refuses_hostile_values(value):
    assert _field_of(lambda: SftDataset(hf_path=value, train_split="train")) == "hf_path"


@pytest.mark.parametrize("value", [*HOSTILE, "/", "", "a/./b"])
def test_venv_refuses_hostile_values(value):
    assert _field_of(lambda: tpu_runtime(venv=value)) == "venv"


@pytest.mark.parametrize("value", [*HOSTILE, "relative/dir", "/dev/shm/../etc"])
def test_paths_refuse_hostile_values(value):
    spec = _seed_spec("gemma3-4b")
    assert _field_of(lambda: RunLayout("gemma3-4b", "r", root=value)) == "root"
    assert _field_of(lambda: maxtext.to_huggingface(spec, value)) == "trained_params"
    assert _field_of(lambda: cpu_runtime(value, "/v")) == "launcher_dir"


@pytest.mark.parametrize(
    "pair",
    [
        "steps=5",
        "run_name=x",
        "base_output_directory=/tmp",
        "load_parameters_path=/x",
        "checkpoint_period=1",
        "x=$(id)",
        "x=`id`",
        "x=a;b",
        "x=a&&b",
        "x=a|b",
        "x=a\nb",
        'x="a"',
        "x=../a",
        "Bad=1",
        "rl..x=1",
        "lora.enable_lora=true",
        ".x=1",
        "x.=1",
        "novalue",
    ],
)
def test_overrides_refuse_reserved_keys_and_hostile_values(pair):
    assert _field_of(lambda: maxtext.train_sft(_seed_spec("gemma3-4b"), overrides=[pair])) == "overrides[0]"


def test_cpu_only_keys_are_reserved_on_cpu():
    assert _field_of(lambda: maxtext.train_rl(_cpu_spec(), overrides=["max_target_length=1024"])) == "overrides[0]"
    assert _field_of(lambda: maxtext.train_sft(_cpu_spec(), overrides=["base_emb_dim=8"])) == "overrides[0]"


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: maxtext.train_sft(s, steps=0), "steps"),
        (lambda s: maxtext.train_sft(s, steps=True), "steps"),
        (lambda s: maxtext.train_sft(s, per_device_batch_size=-1), "per_device_batch_size"),
        (lambda s: maxtext.train_sft(s, checkpoint_period=0), "checkpoint_period"),
        (lambda s: maxtext.train_sft(s, profiler="xplane;id"), "profiler"),
        (lambda s: maxtext.train_rl(s, num_batches=0), "num_batches"),
        (lambda s: maxtext.train_rl(s, num_test_batches=0), "num_test_batches"),
        (lambda s: s.layout.sft_params(0), "steps"),
    ],
)
def test_counts_and_choices_are_validated(call, field):
    assert _field_of(lambda: call(_seed_spec("gemma3-4b"))) == field


def test_dataset_columns_are_validated():
    assert (
        _field_of(lambda: SftDataset("owner/chats", "train", train_data_columns="['a'];id")) == "train_data_columns"
    )
    assert _field_of(lambda: RlDataset("owner/maths", "main/../x-*.parquet", "t.parquet")) == "hf_train_files"
    assert _field_of(lambda: RlDataset("owner/maths", "main/train.parquet", "/t.parquet")) == "hf_eval_files"
    assert _field_of(lambda: RlDataset("maths", "a.parquet", "b.parquet")) == "rl_dataset"


def test_unknown_values_list_the_valid_ones():
    with pytest.raises(SpecError, match="v6e-8") as err:
        accelerator("v5e-8")
    assert err.value.field == "accelerator_type"
    assert set(ACCELERATORS) == {"v6e-1", "v6e-4", "v6e-8", "cpu", "cpu-highmem-16", *SLICE_ACCELERATORS}
    with pytest.raises(SpecError, match="gemma3-4b"):
        model_profile("gpt-5")


def test_script_of_hostile_values_is_inert(tmp_path):
    """Values that would run commands if unquoted reach the program unchanged, and run nothing."""
    canary = tmp_path / "ran"
    hostile = [
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"a; touch {canary}",
        f"a && touch {canary} || b",
        "a'b\"c",
        "x\ny",
        "$HOME",
        "*",
        "-rf",
        "",
    ]
    program = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['HOSTILE']]))"
    command = maxtext.RemoteCommand(argv=("python3", "-c", program, *hostile), env={"HOSTILE": hostile[0]})
    script = command.script()
    exec_part = script[script.index("\nexec ") + 1 :]
    assert shlex.split(exec_part) == ["exec", *command.argv]
    result = _bash(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == json.dumps([hostile, hostile[0]])
    assert not canary.exists()


def test_env_names_are_validated():
    bad = maxtext.RemoteCommand(argv=("true",), env={"X;id": "1"})
    assert _field_of(bad.script) == "env"


# --- run names ----------------------------------------------------------------------------------------------


def test_run_name_is_deterministic_short_and_distinct():
    first = run_name("sft_gemma3", "manual__2026-01-05T10:00:00+00:00")
    assert first == run_name("sft_gemma3", "manual__2026-01-05T10:00:00+00:00")
    assert first != run_name("sft_gemma3", "manual__2026-01-05T10:00:01+00:00")
    assert first.startswith("sft-gemma3-")
    long = run_name("x" * 300 + "!$;", "r" * 500, datetime(2026, 1, 5, tzinfo=UTC))
    assert len(long) <= 64
    for name in (first, long, run_name("___", "r")):
        assert RunLayout("gemma3-4b", name).run_name == name  # valid as a run name and path segment
    # A truncated DAG id still keeps runs of different DAGs apart.
    assert run_name("a" * 40 + "1", "r") != run_name("a" * 40 + "2", "r")


def test_run_name_shows_the_logical_date_in_utc():
    paris = timezone(timedelta(hours=1))
    name = run_name("backfill_dag", "backfill__2026-01-05", datetime(2026, 1, 5, 11, 30, tzinfo=paris))
    assert "-2026-01-05-10-30-00-" in name
    assert _field_of(lambda: run_name("", "r")) == "dag_id"
    assert _field_of(lambda: run_name("d", None)) == "run_id"


# --- install ------------------------------------------------------------------------------------------------


def test_tpu_install_follows_the_seeds():
    script = install.install_script(tpu_runtime(), "0.2.3")
    for seed_step in (
        "apt update",
        "apt upgrade -y --fix-missing",
        "apt install -y build-essential cmake ninja-build",
        "uv python install 3.12",
        'uv venv --python 3.12 --seed "$venv"',
        'source "$venv/bin/activate"',
        "UV_TORCH_BACKEND=cpu uv pip install 'maxtext[tpu-post-train]==0.2.3' --resolution=lowest",
        "install_tpu_post_train_extra_deps",
    ):
        assert seed_step in script
    assert 'venv="$HOME"/maxtext_venv' in script.splitlines()
    assert script.index("exit 0") < script.index("apt update")  # the guard comes first


@pytest.mark.parametrize("version", ["0.2", "0.2.3; rm -rf /", "latest", "0.2.3\n", ""])
def test_install_version_is_validated(version):
    assert _field_of(lambda: install.install_script(tpu_runtime(), version)) == "maxtext_version"


def test_install_reruns_are_noops(tmp_path):
    """A stand-in `uv` records its calls: the first run installs and writes the marker, the second reuses."""
    bin_dir, calls, venv = tmp_path / "bin", tmp_path / "calls", tmp_path / ".venvs" / "maxtext"
    bin_dir.mkdir()
    fake_uv = bin_dir / "uv"
    fake_uv.write_text(
        f'#!/bin/bash\necho "$*" >>{shlex.quote(str(calls))}\n'
        f'if [[ $1 == venv ]]; then mkdir -p "${{@: -1}}/bin" && touch "${{@: -1}}/bin/python" '
        f'&& chmod +x "${{@: -1}}/bin/python"; fi\n'
    )
    fake_uv.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    runtime = cpu_runtime("/opt/launchers", str(venv), "/usr/bin/python3.12")
    script = install.install_script(runtime, "0.2.5")
    check = install.installed_check(runtime, "0.2.5")  # what the install task asks before starting a job
    assert subprocess.run(["bash", "-c", check], capture_output=True).returncode == 1

    first = _bash(script, env)
    assert first.returncode == 0, first.stderr
    assert "Installed MaxText" in first.stdout
    recorded = calls.read_text().splitlines()
    assert recorded[0] == f"venv --python /usr/bin/python3.12 {venv}"
    assert recorded[1].endswith("maxtext[tpu]==0.2.5 google-tunix==0.1.7")
    assert (venv / "overrides.txt").read_text() == "safetensors>=0.8.0\njax<0.12.1\njaxlib<0.12.1\n"

    second = _bash(script, env)
    assert second.returncode == 0 and "Reusing the MaxText environment" in second.stdout
    assert calls.read_text().splitlines() == recorded
    checked = subprocess.run(["bash", "-c", check], capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout == second.stdout
    assert subprocess.run(["bash", "-c", install.installed_check(runtime, "0.2.3")]).returncode == 1

    other_version = _bash(install.install_script(cpu_runtime("/opt/launchers", str(venv)), "0.2.3"), env)
    assert "Installed MaxText" in other_version.stdout  # a different version is not mistaken for installed
    assert len(calls.read_text().splitlines()) == len(recorded) + 1  # the venv is reused, packages installed


def _stand_in_tools(bin_dir, calls):
    """Stand-ins for what the tutorials' install calls (sudo apt, uv, the extra-deps script).

    Each records its call; `uv python install` and `uv venv` leave what the real ones leave in $HOME (the
    venv's python is this test's python, which has google-cloud-storage as MaxText's venv has). `uv run` (the
    storage tool before the venv exists) is the real uv's, unrecorded."""
    bin_dir.mkdir()
    record = f'echo "$(basename "$0") $*" >>{shlex.quote(str(calls))}\n'
    real_uv = shutil.which("uv")
    python = shlex.quote(sys.executable)
    tools = {
        "sudo": record,
        "install_tpu_post_train_extra_deps": record,
        "uv": f'if [[ $1 == run ]]; then exec {shlex.quote(str(real_uv))} "$@"; fi\n'
        + record
        + 'if [[ $1 == python ]]; then mkdir -p "$HOME/.local/share/uv/python/cpython-3.12" '
        '&& echo interpreter >"$HOME/.local/share/uv/python/cpython-3.12/python"; fi\n'
        f'if [[ $1 == venv ]]; then v="${{@: -1}}"; mkdir -p "$v/bin" '
        f'&& printf \'#!/bin/sh\\nexec %s "$@"\\n\' {python} >"$v/bin/python" '
        '&& chmod +x "$v/bin/python" && touch "$v/bin/activate"; fi\n'
        'if [[ $1 == pip ]]; then echo "site-packages" >"$VIRTUAL_ENV_MARK"; fi\n',
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)


@contextlib.contextmanager
def _environment_cache(tmp_path, cache: str):
    """``(cache URI, storage directory, GCS server or None, the VMs' storage environment)``.

    The cache is a directory, or ``gs``: the local GCS server, reached through vm_scripts/gcs_tool.py."""
    from airflow_tpu_posttrain.local.gcs_server import GcsServer, client_environment

    storage = tmp_path / "storage"
    if cache == "directory":
        yield str(storage / "environments"), storage, None, {}
        return
    with GcsServer(tmp_path / "gcs", buckets=("bucket",)) as server:
        vm_env = client_environment(server.url)
        # The VMs' uv keeps its cache where this machine's is (as the local VMs get a copy of the package mirror).
        vm_env["UV_CACHE_DIR"] = subprocess.run(["uv", "cache", "dir"], capture_output=True, text=True).stdout.strip()
        yield "gs://bucket/posttrain/environments", storage, server, vm_env


def _bucket_objects(server, prefix: str) -> list[str]:
    from unittest import mock

    from google.cloud import storage as gcs_client

    with mock.patch.dict(os.environ, {"STORAGE_EMULATOR_HOST": server.url}):
        return [b.name for b in gcs_client.Client().list_blobs("bucket", prefix=prefix)]


@pytest.mark.parametrize("cache", ["directory", "gs"])
def test_a_new_vm_restores_the_environment_saved_by_the_first(tmp_path, cache):
    """The tutorials' install once: a fresh VM restores the environment the first VM saved.

    The VM that saves uploads an archive of the venv (and uv's interpreter) to the cache; a fresh VM (an empty
    $HOME) restores it instead of running apt/uv; a new version installs again."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    _stand_in_tools(bin_dir, calls)
    tool_script = str(Path(install.__file__).parents[1] / "vm_scripts" / "gcs_tool.py")
    with _environment_cache(tmp_path, cache) as (cache_uri, storage, server, vm_env):

        def new_vm(name: str) -> dict[str, str]:
            home = tmp_path / name
            home.mkdir()
            mark = home / "maxtext_venv" / "lib-installed"
            return {**os.environ, **vm_env, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
                    "VIRTUAL_ENV_MARK": str(mark)}

        _save_and_restore(tmp_path, calls, storage, server, cache_uri, tool_script, new_vm)


@pytest.mark.parametrize("cache", ["directory", "gs"])
def test_an_archive_cut_short_is_never_saved(tmp_path, cache):
    """Tar failing midway after part of the archive went out: nothing is saved under the archive's name.

    Midway: a disk error, a file vanishing. Were it saved, the next VM would restore a truncated archive and
    fail to untar it, every time. The install itself succeeds."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    _stand_in_tools(bin_dir, calls)
    real_tar = shutil.which("tar")
    (bin_dir / "tar").write_text(
        f'#!/bin/bash\nif [[ $1 == -cz ]]; then head -c 300000 /dev/urandom; exit 2; fi\nexec {real_tar} "$@"\n'
    )
    (bin_dir / "tar").chmod(0o755)
    tool_script = str(Path(install.__file__).parents[1] / "vm_scripts" / "gcs_tool.py")
    with _environment_cache(tmp_path, cache) as (cache_uri, storage, server, vm_env):
        home = tmp_path / "vm"
        home.mkdir()
        env = {**os.environ, **vm_env, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "VIRTUAL_ENV_MARK": str(home / "maxtext_venv" / "lib-installed")}
        saver = install.install_script(tpu_runtime(), "0.2.3", cache_uri, save=True, storage_tool_script=tool_script)
        run = _bash(saver, env)
        assert run.returncode == 0, run.stderr
        assert "Could not save the environment archive; the next VM installs again" in run.stdout
        if server is None:
            saved = [p.name for p in storage.rglob("*") if p.is_file()]
        else:
            saved = _bucket_objects(server, "posttrain/")
        assert not [name for name in saved if name.endswith(".tar.gz")], saved


def _save_and_restore(tmp_path, calls, storage, server, cache_uri, tool_script, new_vm):
    saver = install.install_script(tpu_runtime(), "0.2.3", cache_uri, save=True, storage_tool_script=tool_script)
    first_vm = new_vm("cpu-vm")
    first = _bash(saver, first_vm)
    assert first.returncode == 0, first.stderr
    assert "Installed MaxText" in first.stdout and "Saving the MaxText environment" in first.stdout
    installed = calls.read_text().splitlines()
    assert any(c.startswith("sudo ") for c in installed) and "install_tpu_post_train_extra_deps " in installed
    if server is None:
        [archive] = list(storage.rglob("*.tar.gz"))
        assert archive.name.startswith("maxtext-env-tpu-") and not list(storage.rglob("*.partial"))
    else:
        [name] = _bucket_objects(server, "posttrain/")  # the archive, and no partial object left beside it
        assert name.startswith("posttrain/environments/maxtext-env-tpu-") and name.endswith(".tar.gz")

    restorer = install.install_script(tpu_runtime(), "0.2.3", cache_uri, save=False, storage_tool_script=tool_script)
    second_vm = new_vm("tpu-vm")
    second = _bash(restorer, second_vm)
    assert second.returncode == 0, second.stderr
    assert "Restored the MaxText environment" in second.stdout
    assert calls.read_text().splitlines() == installed  # no apt, no uv, no pip on the second VM
    home = Path(second_vm["HOME"])
    assert (home / "maxtext_venv" / "lib-installed").read_text() == "site-packages\n"
    assert (home / ".local/share/uv/python/cpython-3.12/python").is_file()  # the interpreter the venv links to

    other = _bash(install.install_script(tpu_runtime(), "0.2.5", cache_uri, storage_tool_script=tool_script), new_vm("newer"))
    assert "Installed MaxText" in other.stdout and "Restored" not in other.stdout


def test_every_vm_of_a_slice_trains_with_the_same_argv_told_its_worker_id_and_every_vms_address():
    addresses = ("10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5")
    on_tpu = dataclasses.replace(_seed_spec("gemma3-4b"), accelerator=accelerator("v6e-16"))
    commands = [
        maxtext.train_sft(dataclasses.replace(on_tpu, worker=maxtext.SliceWorker(i, addresses))) for i in range(4)
    ]
    assert all(command.argv == commands[0].argv for command in commands)
    for i, command in enumerate(commands):
        assert command.env["TPU_WORKER_ID"] == str(i)
        assert command.env["TPU_WORKER_HOSTNAMES"] == "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5"
        assert (command.env["TPU_TOPOLOGY"], command.env["TPU_HOST_BOUNDS"]) == ("4x4", "2,2,1")
    # Built for no VM in particular, a slice's training is refused: it would run one JAX process of several.
    with pytest.raises(SpecError, match="is a multi-host slice; its training runs on every VM"):
        maxtext.train_sft(on_tpu)

    # The local slice (a CPU per VM): MaxText's CPU path joins the processes through jax.distributed.
    twin = maxtext.RunSpec(
        model=model_profile("tiny-gemma3-4b"),
        accelerator=accelerator("v6e-16"),
        runtime=cpu_runtime("/opt/launchers", "/var/tmp/maxtext-venv"),
        layout=RunLayout("tiny-gemma3-4b", "tiny-run"),
        worker=maxtext.SliceWorker(1, addresses[:2]),
    )
    local = maxtext.train_sft(twin)
    assert "hardware=cpu" in local.argv and not any(a.startswith("skip_jax_distributed_system") for a in local.argv)
    assert {key: local.env[key] for key in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JOB_COMPLETION_INDEX")} == {
        "JAX_COORDINATOR_ADDRESS": "10.0.0.2", "JAX_PROCESS_COUNT": "2", "JOB_COMPLETION_INDEX": "1"
    }
