"""Local-only launcher: `maxtext.trainers.post_train.rl.train_rl` (GRPO) on CPU.

Takes exactly train_rl's argv; works with maxtext 0.2.3 and 0.2.5 (google-tunix 0.1.7). train_rl's rollout
engine is vLLM on TPU (tpu_inference, vLLM and TPU-only Pallas kernels, none of them installed or usable
here). This launcher puts stand-ins for the modules that reach it into sys.modules (see
install_vllm_stand_ins), all resolving to `CpuRollout`, a small KV-cache-free sampler that re-runs the
actor's forward pass for every new token. Then it runs train_rl's main unchanged. Fine for a model with a
few hundred thousand parameters, far too slow for a real one.
"""

import functools
import logging
import runpy
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl import common
from tunix.rl.rollout import base_rollout

MODULE = "maxtext.trainers.post_train.rl.train_rl"
VLLM_PACKAGE = "maxtext.integration.vllm"
TUNIX_ROLLOUT_PACKAGE = "tunix.rl.rollout"
log = logging.getLogger("train_rl_cpu")


def _filter_logits(logits: jax.Array, top_k: int | None, top_p: float | None) -> jax.Array:
    """Sets logits outside the top-k / nucleus (top-p) set to -inf; logits is [batch, vocab]."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        descending = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(descending, axis=-1), axis=-1)
        cutoff_index = jnp.sum(cumulative < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(descending, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def _next_tokens(graphdef, state, tokens, valid, index, rng, *, temperature, top_k, top_p):
    """Samples the token at column `index` for each row of `tokens` ([batch, width], left-padded).

    `valid` marks real tokens; it gives the positions and the segment ids that keep padding out of
    attention. The full width is recomputed each time so that every call has the same shapes.
    """
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    logits, _ = model(tokens, positions, None, None, decoder_segment_ids=valid)
    logits = jax.lax.dynamic_index_in_dim(logits, index - 1, axis=1, keepdims=False).astype(jnp.float32)
    if temperature <= 0.0 or top_k == 1:
        return jnp.argmax(logits, axis=-1)
    logits = _filter_logits(logits / temperature, top_k, top_p)
    return jax.random.categorical(rng, logits, axis=-1)


class CpuRollout(base_rollout.BaseRollout):
    """Tunix rollout engine that samples with the actor model itself, without a KV cache.

    Constructed as either engine train_rl asks for: MaxTextVllmRollout (keyword arguments, plus
    maxtext_config) or tunix's VllmRollout (actor and tokenizer positionally, plus cache_config_or_size).
    The mesh both pass is unused: the actor's own sharding applies. Prompts are left-padded to
    rollout_config.max_prompt_length and sequences span that plus max_tokens_to_generate (train_rl sets
    these to max_prefill_predict_length and max_target_length - max_prefill_predict_length), so one
    compilation serves every call with the same batch size and sampling settings.
    """

    def __init__(self, rollout_actor, tokenizer, *, rollout_config, **_):
        self._model = rollout_actor
        self._tokenizer = tokenizer
        self._prompt_width = rollout_config.max_prompt_length
        self._total_width = rollout_config.max_prompt_length + rollout_config.max_tokens_to_generate
        self._rng = jax.random.PRNGKey(int(rollout_config.seed) if rollout_config.seed is not None else 0)
        self._next_tokens = jax.jit(
            functools.partial(_next_tokens, nnx.graphdef(rollout_actor)),
            static_argnames=("temperature", "top_k", "top_p"),
        )

    def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
        pad_id = self.pad_id()
        eos_ids = set(rollout_config.eos_tokens or [self.eos_id()])
        num_steps = min(rollout_config.max_tokens_to_generate, self._total_width - self._prompt_width)

        tokens = np.full((len(prompts), self._total_width), pad_id, dtype=np.int32)
        valid = np.zeros_like(tokens)
        for row, prompt in enumerate(prompts):
            prompt_ids = self._tokenize(prompt)
            if len(prompt_ids) > self._prompt_width:
                log.warning(
                    "CpuRollout: prompt of %d tokens cut to its last %d", len(prompt_ids), self._prompt_width
                )
                prompt_ids = prompt_ids[-self._prompt_width :]
            tokens[row, self._prompt_width - len(prompt_ids) : self._prompt_width] = prompt_ids
            valid[row, self._prompt_width - len(prompt_ids) : self._prompt_width] = 1
        left_padded_prompts = tokens[:, : self._prompt_width].copy()

        state = nnx.state(self._model)
        completions = [[] for _ in prompts]
        finished = np.zeros(len(prompts), dtype=bool)
        for step in range(num_steps):
            column = self._prompt_width + step
            self._rng, key = jax.random.split(self._rng)
            sampled = np.asarray(
                self._next_tokens(
                    state,
                    tokens,
                    valid,
                    column,
                    key,
                    temperature=float(rollout_config.temperature),
                    top_k=rollout_config.top_k,
                    top_p=rollout_config.top_p,
                )
            )
            active = ~finished
            tokens[active, column] = sampled[active]
            valid[active, column] = 1
            for row in np.flatnonzero(active):
                if int(sampled[row]) in eos_ids:
                    finished[row] = True
                else:
                    completions[row].append(int(sampled[row]))
            if finished.all():
                break

        # Like tunix's own samplers: completions stop before EOS.
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(ids) for ids in completions],
            logits=None,
            tokens=[np.asarray(ids, dtype=np.int32) for ids in completions],
            left_padded_prompt_tokens=left_padded_prompts,
            logprobs=None,
        )

    def _tokenize(self, text: str) -> list[int]:
        """Token ids with a single leading BOS.

        Chat-templated prompts already start with one, and encode() adds another (tunix's own sampler dedups
        the same way)."""
        return self._tokenizer.dedup_bos_ids(self._tokenizer.encode(text))

    def get_per_token_logps(self, prompt_tokens, completion_tokens):
        graphdef, state = nnx.split(self._model)
        return common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            pad_id=self.pad_id(),
            eos_id=self.eos_id(),
            stop_gradient=True,
            return_logits=False,
        )

    def update_params(self, params, filter_types=None):
        nnx.update(self._model, params)

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self):
        return self._model


def install_vllm_stand_ins() -> None:
    """Registers stand-ins for the vLLM rollout modules train_rl reaches; each resolves to CpuRollout.

    - maxtext.integration.vllm.maxtext_vllm_rollout (train_rl imports MaxTextVllmRollout at module
      level: 0.2.3 train_rl.py:119, 0.2.5 train_rl.py:81). The real module imports tunix's vLLM sampler,
      hence vllm, which is not installed. 0.2.5 always uses it (train_rl.py:413); 0.2.3 only with
      use_standalone_converter=true (train_rl.py:428-432).
    - maxtext.integration.vllm.maxtext_vllm_adapter, a no-op register(): 0.2.5 imports it and calls
      adapter.register() at import (train_rl.py:67-69), which registers MaxText models with vLLM. Harmless
      on 0.2.3, which never imports it.
    - tunix.rl.rollout.vllm_rollout: 0.2.3 passes rollout_engine="vllm" (train_rl.py:428-432, as
      use_standalone_converter defaults to false), for which tunix 0.1.7 imports this module and
      constructs VllmRollout (rl/rl_cluster.py:407-431). The real module imports
      tunix.generate.vllm_sampler, hence vllm. Never reached on 0.2.5.
    """
    import maxtext.integration.vllm as vllm_package
    import tunix.rl.rollout as tunix_rollout_package

    adapter = types.ModuleType(f"{VLLM_PACKAGE}.maxtext_vllm_adapter")
    adapter.register = lambda: None
    rollout = types.ModuleType(f"{VLLM_PACKAGE}.maxtext_vllm_rollout")
    rollout.MaxTextVllmRollout = CpuRollout
    tunix_rollout = types.ModuleType(f"{TUNIX_ROLLOUT_PACKAGE}.vllm_rollout")
    tunix_rollout.VllmRollout = CpuRollout
    for package, module in (
        (vllm_package, adapter),
        (vllm_package, rollout),
        (tunix_rollout_package, tunix_rollout),
    ):
        sys.modules[module.__name__] = module
        setattr(package, module.__name__.rsplit(".", 1)[1], module)


if __name__ == "__main__":
    install_vllm_stand_ins()
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
