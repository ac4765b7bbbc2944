"""Chat conversations -> prompt token ids through a chat template (``LLM.chat`` and the
server's ``/v1/chat/completions`` share it)."""

from __future__ import annotations

import json
from typing import Any


class MissingChatTemplate(ValueError):
    """The tokenizer has no chat template and none was given."""


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,  # None: the tokenizer's own
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,  # OpenAI tool definitions, for the template
) -> tuple[str, list[int]]:
    """(prompt text, prompt token ids) of a conversation; ValueError naming what is missing."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat is unavailable")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise MissingChatTemplate(
            "this model's tokenizer has no chat template (no 'chat_template' in its "
            "tokenizer_config.json); pass a chat_template or use plain prompts"
        )
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **({"tools": tools} if tools else {}),
            **(template_kwargs or {}),  # a "tools" here would be a TypeError: caught below
        )
    except Exception as err:  # jinja errors: the template rejected these messages
        raise ValueError(f"the chat template failed on these messages: {err}") from None
    # the template writes any BOS itself, so the tokenizer must not add another
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a chat template: an assistant's earlier calls carry their arguments as
    objects, as templates expect (OpenAI sends them as JSON text), like vLLM."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_decoded_arguments(c) for c in calls]}
        out.append(message)
    return out


def _decoded_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text
    return {**call, "function": {**function, "arguments": arguments}}
