"""Shared by the conversion launchers: in-process patches that let MaxText's converters run a shrunk model.

Standard library only at import; MaxText, transformers and safetensors are imported inside the functions (they
are in the MaxText venv the launchers run with). Tested with maxtext[tpu] 0.2.2, 0.2.3 and 0.2.5.
"""

import importlib.metadata
import os
import sys
import types


def _arg_value(argv: list[str], name: str) -> str | None:
    """Value of `name=V`, `--name=V` or `--name V` in argv (the forms MaxText's converters accept)."""
    for i, arg in enumerate(argv):
        for prefix in (f"{name}=", f"--{name}="):
            if arg.startswith(prefix):
                return arg[len(prefix) :]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _log(launcher: str, message: str) -> None:
    print(f"[{launcher}] {message}", file=sys.stdout, flush=True)


def use_model_config(argv: list[str], launcher: str) -> None:
    """``HF_MODEL_CONFIGS[model_name]`` becomes the model's real Hugging Face config.

    Why: both converters map weights with a hard-coded config per model_name (hf_model_configs.py), e.g. for
    gemma3-4b 34 text layers and hidden 2560 (the embedding is scaled by sqrt(text_config.hidden_size) in
    param_mapping.py's GEMMA3 hook). With shrunk dims (``override_model_config=true ...``) conversion fails
    ("... not found") or is silently wrong; ``--override_model_architecture`` does not help for Gemma 3 (its
    config has no top-level hidden_size etc., so to_huggingface's _validate_or_update_architecture skips it).

    Where from: the ``--hf_model_path`` directory when given; else the Hub repo MaxText itself reads the
    weights (to_maxtext) and tokenizer (to_huggingface) from, ``HF_IDS[model_name]`` (maxtext/utils/globals.py),
    at ``--revision`` if given, with the environment's HF_TOKEN, so the production argv needs no extra flag.
    """
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from maxtext.utils.globals import HF_IDS
    from transformers import AutoConfig

    model_name = _arg_value(argv, "model_name")
    if not model_name:
        return
    source = _arg_value(argv, "hf_model_path")
    revision = None
    if not source:
        source = HF_IDS.get(model_name)
        revision = _arg_value(argv, "revision")
        if source is None:
            return  # MaxText refuses the model name itself
    config = AutoConfig.from_pretrained(source, token=os.environ.get("HF_TOKEN"), revision=revision)
    # to_maxtext looks the table up under the name without "-Instruct", to_huggingface under the name itself.
    for key in {model_name, model_name.replace("-Instruct", "")}:
        HF_MODEL_CONFIGS[key] = config
    _log(
        launcher,
        f"HF_MODEL_CONFIGS[{model_name!r}] <- {source}{'@' + revision if revision else ''} config.json",
    )


def stub_torch_if_missing(launcher: str) -> None:
    """MaxText 0.2.2 only: an empty ``torch`` module when PyTorch is not installed.

    Why: 0.2.2's to_maxtext.py:73 and standalone_scripts/llama_or_mistral_ckpt.py:57 (imported by it at :80)
    ``import torch`` at module level, though the lazy path (``--lazy_load_tensors=True``) never calls it
    (only the eager getter, to_maxtext.py:671-686, does). maxtext[tpu] does not install torch. From 0.2.3 the
    import is guarded (``try: import torch except ImportError: torch = None``) and a stub would be wrong:
    0.2.5's LazyHFLoader.get_tensor picks ``framework="pt"`` when torch is not None.
    Install after transformers is imported, which decides whether torch is available at its import.
    """
    if importlib.metadata.version("maxtext") != "0.2.2":
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.modules["torch"] = types.ModuleType("torch")
        _log(launcher, "torch is not installed: an empty stub module stands in for 0.2.2's unused imports")


# Tensor names as MaxText's Gemma 3 mapping asks for them (transformers >= 4.52) -> as the Hub's files have them.
_LEGACY_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def legacy_tensor_names(launcher: str) -> None:
    """``safetensors.safe_open`` handles fall back to the pre-transformers-4.52 names of a tensor.

    Why: MaxText's Gemma 3 mapping (param_mapping.py GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING, 0.2.2 :82) names
    tensors as transformers >= 4.52 does (``model.language_model.*``): right for the eager load through
    ``Gemma3ForConditionalGeneration.from_pretrained`` (the production default, which renames on load), but
    the Hub's google/gemma-3-4b-it files hold ``language_model.model.*`` and the lazy loader reads the file
    directly (LazyHFLoader.get_tensor, 0.2.2 to_maxtext.py:209), so it fails with "... not found". Only for a
    single-file checkpoint: with a shard index the lookup fails before the file is opened (to_maxtext.py:186).
    Must run before the wrapped module executes ``from safetensors import safe_open``.
    """
    import safetensors

    original = safetensors.safe_open

    class _Handle:
        def __init__(self, handle):
            self._inner = handle
            self._names = set(handle.keys())

        def __enter__(self):
            self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

        def get_tensor(self, name):
            if name not in self._names:
                for new, old in _LEGACY_PREFIXES:
                    if name.startswith(new) and old + name[len(new) :] in self._names:
                        name = old + name[len(new) :]
                        break
            return self._inner.get_tensor(name)

        def __getattr__(self, attribute):
            return getattr(self._inner, attribute)

    def safe_open(*args, **kwargs):
        return _Handle(original(*args, **kwargs))

    safetensors.safe_open = safe_open
    _log(launcher, "safe_open falls back to the Hub files' pre-4.52 tensor names (language_model.model.*)")
