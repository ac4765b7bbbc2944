"""Prompt renderers: turn a request's prompt (text, token ids, chat messages) into engine input.

A renderer is called on a tokenizer thread (``serve/tokenization.py``) with that thread's own
tokenizer copy, so no tokenizer is shared between threads and the engine thread never tokenizes.
Problems raise BadRequest before anything is queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_llm.engine.chat import MissingChatTemplate, render_chat
from paged_llm.pooling.scoring import cross_encoder_input
from paged_llm.serve.errors import BadRequest

# (tokenizer or None) -> {"prompt_token_ids": [...], "prompt": text or None}
PromptRenderer = Callable[[Any], dict[str, Any]]


def text_prompt(text: str, add_special_tokens: bool = True) -> PromptRenderer:
    """A completion prompt given as text."""

    def render(tokenizer: Any) -> dict[str, Any]:
        if tokenizer is None:
            raise BadRequest(
                "this model has no tokenizer; send the prompt as a list of token ids",
                param="prompt",
            )
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"prompt_token_ids": list(ids), "prompt": text}

    return render


def token_prompt(token_ids: list[int], decode: bool = False) -> PromptRenderer:
    """A completion prompt given as token ids (checked against the vocabulary by the engine);
    ``decode`` also gives its text (for echo)."""

    def render(tokenizer: Any) -> dict[str, Any]:
        text = None
        if decode and tokenizer is not None:
            try:
                text = tokenizer.decode(list(token_ids))
            except Exception:  # ids outside the vocabulary: the engine names the problem
                text = None
        return {"prompt_token_ids": list(token_ids), "prompt": text}

    return render


def completion_prompt(
    prompt: str | list[int], add_special_tokens: bool = True, decode: bool = False
) -> PromptRenderer:
    """One prompt of a completion-style request (text, or token ids; ``decode``: their text
    too, for echo)."""
    if isinstance(prompt, str):
        return text_prompt(prompt, add_special_tokens)
    return token_prompt(prompt, decode=decode)


def pair_prompt(first: str | list[int], second: str | list[int]) -> PromptRenderer:
    """A cross-encoder's input: two texts tokenized together as a pair, or token ids joined
    (``pooling.scoring.cross_encoder_input``)."""

    def render(tokenizer: Any) -> dict[str, Any]:
        try:
            return cross_encoder_input(first, second, tokenizer)
        except ValueError as err:
            raise BadRequest(str(err)) from None

    return render


def chat_prompt(
    messages: list[dict[str, Any]],
    chat_template: str | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> PromptRenderer:
    """A conversation (and the tools it may call) rendered with the server's or the
    tokenizer's chat template."""

    def render(tokenizer: Any) -> dict[str, Any]:
        try:
            text, ids = render_chat(tokenizer, messages, chat_template, add_generation_prompt,
                                    continue_final_message, template_kwargs, tools)  # fmt: skip
        except MissingChatTemplate as err:  # the server has its own way to supply one
            raise BadRequest(
                f"{err}; start the server with --chat-template FILE or use /v1/completions",
                param="messages",
            ) from None
        except ValueError as err:
            raise BadRequest(str(err)) from None
        return {"prompt_token_ids": ids, "prompt": text}

    return render


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Refuse prompt + max_tokens beyond the context (vLLM's server rule; the offline engine
    silently caps max_tokens instead)."""
    if num_prompt_tokens >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens, leaving no room to generate.",
            param="prompt",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
