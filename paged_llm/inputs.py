"""vLLM's prompt types (``vllm.inputs``): what ``LLM.generate``, ``LLMEngine.add_request`` and
``AsyncLLMEngine.generate`` take as one prompt. They are plain dicts, so vLLM code that builds
``TokensPrompt(prompt_token_ids=[...])`` works with the import changed; a bare string or a list
of token ids is accepted too."""

from __future__ import annotations

from typing import TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids; ``prompt`` (optional) is its text, shown in the output."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]  # noqa: UP007 (a runtime alias)
