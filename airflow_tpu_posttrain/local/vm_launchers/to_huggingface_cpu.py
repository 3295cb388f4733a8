"""Local-only launcher: `maxtext.checkpoint_conversion.to_huggingface` for a shrunk model, on a CPU.

Takes exactly to_huggingface's argv. to_huggingface starts from a hard-coded Hugging Face config per
model_name (HF_MODEL_CONFIGS): the export would get the big model's dims (gemma3-4b: --override_model_architecture
changes nothing, its config has no top-level dims), or, where the flag works, the big model's other fields
(bos/eos ids, rope, dtype). This replaces the entry with the model's real config (--hf_model_path if given,
else HF_IDS[model_name] on the Hub named by HF_ENDPOINT, read with HF_TOKEN: the repo to_huggingface takes
the tokenizer from), then runs to_huggingface unchanged.

A LoRA adapter's export (``lora.lora_restore_path``) hands safetensors' numpy writer JAX arrays. The TPU install
(maxtext[tpu-post-train] at its lowest versions) has safetensors 0.7.0, whose writer takes them (``tobytes``);
the CPU venv needs maxtext[tpu]'s safetensors>=0.8.0, whose writer reads ``.ctypes`` and fails on them. So they
are made numpy arrays first. And MaxText's own table gives the exported config MaxText's vocab_size (gemma3-4b:
262144, where the Hub's config says 262208 rows), which 0.2.5's to_huggingface checks against MaxText's config
(``_validate_or_update_architecture``): the real config put in its place gets MaxText's vocab_size too (the
adapter holds no embedding).

Fault injection (tests only): a module ``export_faults.py`` beside this file (the install step copies every ``*.py``
of the local stack's launchers onto the VM) whose ``FAULTS`` maps a part of ``base_output_directory`` (a run name)
to a fault breaks that export once to_huggingface has written it, as a silent export error would:
``permute`` reverses the rows of the first decoder layer's MLP down projection, ``zero_adapter`` zeroes every
``lora_B``, ``drop_module`` removes the first adapted module's ``lora_A`` / ``lora_B``. Each fault strikes once per VM
(a marker beside this file), so the task's retry exports cleanly. The export's fidelity check
(``vm_scripts/export_fidelity.py``) must fail the try it strikes, before anything is kept or published.
"""

import hashlib
import json
import runpy
import struct
import sys
from pathlib import Path

from hf_model_config import use_model_config  # beside this file

MODULE = "maxtext.checkpoint_conversion.to_huggingface"


def use_maxtext_vocab_size(argv: list[str]) -> None:
    """The table's config (now the model's real one) says MaxText's vocab_size, as MaxText's own table does."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS

    args = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))
    if "vocab_size" in args and args.get("model_name") in HF_MODEL_CONFIGS:
        config = HF_MODEL_CONFIGS[args["model_name"]]
        getattr(config, "text_config", config).vocab_size = int(args["vocab_size"])


def write_numpy_arrays() -> None:
    """MaxText's adapter writer hands safetensors numpy arrays, as safetensors 0.8's writer needs."""
    import numpy as np
    from maxtext.checkpoint_conversion.utils import utils

    save_file = utils.numpy_save_file

    def numpy_save_file(tensors, *args, **kwargs):
        return save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()}, *args, **kwargs)

    utils.numpy_save_file = numpy_save_file


def injected_fault(argv: list[str]) -> tuple[str, Path] | None:
    """The fault ``export_faults.FAULTS`` asks of this export, and the export's folder; None: no fault."""
    try:
        from export_faults import FAULTS  # beside this file, written by a test
    except ImportError:
        return None
    args = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))
    output = args.get("base_output_directory", "")
    for part, fault in FAULTS.items():
        struck = Path(__file__).with_name(f".export-fault-{fault}-{hashlib.sha256(part.encode()).hexdigest()[:12]}")
        if part and part in output and not struck.exists():
            struck.touch()
            return fault, Path(output)
    return None


def _read_safetensors(path: Path) -> tuple[dict, dict[str, bytes]]:
    """The header (less its metadata) and each tensor's bytes: any dtype, bfloat16 included (numpy has none)."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    body = data[8 + size :]
    return header, {name: body[info["data_offsets"][0] : info["data_offsets"][1]] for name, info in header.items()}


def _write_safetensors(path: Path, header: dict, tensors: dict[str, bytes]) -> None:
    offset, entries = 0, {"__metadata__": {"format": "pt"}}
    for name in sorted(tensors):
        entries[name] = {**header[name], "data_offsets": [offset, offset + len(tensors[name])]}
        offset += len(tensors[name])
    encoded = json.dumps(entries, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(tensors[name] for name in sorted(tensors)))


def break_export(fault: str, folder: Path) -> None:
    """Break the written export as ``fault`` says (module docstring), in place."""
    name = "adapter_model.safetensors" if fault in ("zero_adapter", "drop_module") else "model.safetensors"
    path = folder / name
    header, tensors = _read_safetensors(path)
    if fault == "permute":
        [key] = [key for key in tensors if key.endswith("layers.0.mlp.down_proj.weight")]
        row = len(tensors[key]) // header[key]["shape"][0]
        rows = [tensors[key][i : i + row] for i in range(0, len(tensors[key]), row)]
        tensors[key] = b"".join(reversed(rows))
    elif fault == "zero_adapter":
        tensors = {key: bytes(len(value)) if ".lora_B." in key else value for key, value in tensors.items()}
    elif fault == "drop_module":
        key = sorted(tensors)[0]
        tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{key.rsplit('.lora_', 1)[0]}.lora_")}
    else:
        raise ValueError(f"unknown export fault {fault!r}")
    _write_safetensors(path, header, tensors)
    print(f"to_huggingface_cpu: FAULT INJECTED: {fault} in {path}", flush=True)


if __name__ == "__main__":
    use_model_config(sys.argv[1:], "to_huggingface_cpu")
    if any(arg.startswith("lora.lora_restore_path=") for arg in sys.argv[1:]):
        use_maxtext_vocab_size(sys.argv[1:])
        write_numpy_arrays()
    fault = injected_fault(sys.argv[1:])
    try:
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as done:  # absl's app.run ends with sys.exit
        if fault and not done.code:
            break_export(*fault)
        raise
    if fault:
        break_export(*fault)
