"""Chat conversations -> prompt token ids through a chat template (``LLM.chat`` and the
server's ``/v1/chat/completions`` share it)."""

from __future__ import annotations

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
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as err:  # jinja errors: the template rejected these messages
        raise ValueError(f"the chat template failed on these messages: {err}") from None
    # the template writes any BOS itself, so the tokenizer must not add another
    return text, list(tokenizer.encode(text, add_special_tokens=False))
