"""Turning user prompts into validated token ids, before any work starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PROMPT_KEYS = ("prompt", "prompt_token_ids")  # paged_llm.inputs.TextPrompt / TokensPrompt


def to_token_ids(prompt: Any, tokenizer: Any) -> tuple[str | None, list[int]]:
    """Return (prompt text or None, token ids) for a string, token list or vLLM-style dict."""
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:  # e.g. multi_modal_data, cache_salt: refused rather than silently ignored
            raise ValueError(f"prompt keys {unknown} are not supported; use {list(PROMPT_KEYS)}")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "this model has no tokenizer; pass {'prompt_token_ids': [...]} instead of text"
            )
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")


def truncate_prompt(token_ids: list[int], keep: int | None) -> list[int]:
    """SamplingParams.truncate_prompt_tokens: the last ``keep`` ids (all of them if None)."""
    return token_ids[-keep:] if keep is not None and len(token_ids) > keep else token_ids


def validate_token_ids(
    token_ids: list[int], vocab_size: int, max_model_len: int, generates: bool = True
) -> None:
    """Raise ValueError for an empty or too long prompt or ids outside the vocabulary (a prompt
    that generates needs room for one more token; a pooling prompt may fill the length)."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) > max_model_len or (generates and len(token_ids) == max_model_len):
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens; max_model_len is {max_model_len}"
            + (", so no token could be generated" if generates else "")
        )
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
