"""A checkpoint's ``generation_config.json``, read as vLLM reads it.

Two things in it change what the engine does:

* ``eos_token_id`` may list several ids (Llama 3's ``<|end_of_text|>``, ``<|eom_id|>`` and
  ``<|eot_id|>``). The tokenizer's own EOS ends a request as always; the others are added to
  each request's ``stop_token_ids`` unless it sets ``ignore_eos``, so they end it too and are
  held back until ``min_tokens``, like any stop token.
* The model creator's recommended sampling settings (``temperature``, ``top_p``, ``top_k``,
  ``min_p``, ``repetition_penalty``, ``max_new_tokens``) are the defaults of requests that leave
  them unset: ``LLM.generate`` without SamplingParams (``LLM.get_default_sampling_params``) and
  the server's requests that omit a field. ``do_sample`` is ignored, as vLLM ignores it: a
  recommended ``temperature`` applies even where the file says ``do_sample: false``.

``generation_config="auto"`` (vLLM's default) reads the model directory's file, ``"vllm"`` keeps
paged-llm's own sampling defaults (the EOS ids are still read), and a directory path reads the
file there instead. ``override_generation_config`` (a dict) is laid over the result, as vLLM's
``--override-generation-config``. A checkpoint without the file falls back to its
``config.json`` ``eos_token_id``, as transformers' ``GenerationConfig.from_model_config``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from paged_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json name -> SamplingParams field (Hugging Face's max_new_tokens is vLLM's
# max_tokens); the only sampling settings vLLM takes from the file
SAMPLING_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """The EOS ids and default sampling settings one checkpoint recommends."""

    eos_token_ids: tuple[int, ...] = ()  # every id the checkpoint calls end-of-sequence
    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams field -> value

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the recommended settings in place of paged-llm's defaults."""
        return SamplingParams(**self.sampling)

    def add_eos_stops(self, params: SamplingParams, model_eos: int | None) -> SamplingParams:
        """``params`` with the EOS ids other than ``model_eos`` among its stop token ids (vLLM's
        ``update_from_generation_config``); the same object when there is nothing to add."""
        extra = [t for t in self.eos_token_ids if t != model_eos and t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return replace(params, stop_token_ids=[*params.stop_token_ids, *extra])


def load_generation_defaults(
    model_dir: Path | None,
    hf_config: Any,
    source: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
) -> GenerationDefaults:
    """Read the defaults for a checkpoint directory (None: a preset without one).

    Raises ValueError naming the file when its settings are not valid SamplingParams.
    """
    if source in ("auto", "vllm"):
        path = None if model_dir is None else Path(model_dir) / FILE_NAME
    else:
        path = Path(source).expanduser() / FILE_NAME
        if not path.is_file():
            raise ValueError(f"generation_config: no {FILE_NAME} in '{source}'")
    raw = _read(path) if path is not None and path.is_file() else {}
    eos = raw.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    eos_ids = _eos_ids(eos, vocab_size)
    config = {} if source == "vllm" else dict(raw)
    config.update(overrides or {})
    unused = sorted(set(overrides or {}) - set(SAMPLING_FIELDS))
    if unused:  # as vLLM, only the sampling fields are read; say so rather than drop a typo
        logger.warning(
            "override_generation_config: %s ignored; only %s are read",
            unused,
            list(SAMPLING_FIELDS),
        )
    sampling = {
        ours: config[theirs] for theirs, ours in SAMPLING_FIELDS.items()
        if config.get(theirs) is not None
    }  # fmt: skip
    defaults = GenerationDefaults(eos_ids, sampling)
    sources = ([str(path)] if raw and source != "vllm" else []) + (
        ["override_generation_config"] if overrides else []
    )
    where = " + ".join(sources) or "generation config"
    try:
        defaults.default_sampling_params().validate()
    except (TypeError, ValueError) as err:
        raise ValueError(f"sampling defaults from {where}: {err}") from None
    if sampling:
        logger.info(
            "default sampling parameters from %s: %s (generation_config='vllm' keeps "
            "paged-llm's own)",
            where, sampling,
        )  # fmt: skip
    return defaults


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def _eos_ids(eos: Any, vocab_size: int | None) -> tuple[int, ...]:
    """An int or a list of ints; ids outside the vocabulary can never be sampled: dropped."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    kept = tuple(
        t for t in ids if isinstance(t, int) and (vocab_size is None or 0 <= t < vocab_size)
    )
    if len(kept) < len(ids):
        logger.warning("eos_token_id %s: ids outside the vocabulary ignored", eos)
    return kept
