"""Request bodies of the OpenAI API (completions, chat, embeddings) and their translation to
SamplingParams / PoolingParams.

Fields beyond OpenAI's are vLLM's extensions with vLLM's names (``top_k``, ``min_p``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ...), so clients written for vLLM work.
Unknown fields are ignored (and logged), as vLLM does; known fields of the wrong type are a 400:
types are checked strictly (``"stream": "yes"`` or ``"max_tokens": 2.0`` is refused, not coerced).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import SamplingParams, StructuredOutputsParams
from paged_llm.serve.errors import BadRequest
from paged_llm.serve.limits import RequestLimits, read_body

logger = logging.getLogger(__name__)

MAX_N = 128  # choices per prompt; the engine samples them in one request
INT64 = (-(2**63), 2**63 - 1)  # seeds: torch generators take 64-bit ones (vLLM's bounds)
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class StreamOptions(BaseModel):
    """``stream_options``: whether the last chunk reports token usage (and, vLLM's
    ``continuous_usage_stats``, every chunk the usage so far)."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the (only) served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's current form: {"json": ..., "regex": ..., "choice": ..., "grammar": ...,
    # "json_object": true}; the guided_* fields below are its older (removed in v0.12) spelling
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # each prompt token's logprob + this many alternatives
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    use_beam_search: bool = False  # vLLM's: n beams instead of n samples (serve/beam_search.py)
    length_penalty: float = 1.0  # beam search: score = logprob sum / length ** length_penalty
    best_of: int | None = None  # sample this many, return the n with the highest logprob sum
    priority: int = 0  # with --scheduling-policy priority: smaller runs sooner
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids too


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    """One message of a conversation; content is text or a list of text parts."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # docs/serving.md, "Tool calling"
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a completion prompt, or chat messages."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # for the chat template, as in a chat request
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's)."""

    model_config = ConfigDict(extra="allow")
    lora_name: str


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (OpenAI's fields; ``truncate_prompt_tokens``, ``normalize``,
    ``add_special_tokens`` and ``priority`` are vLLM's)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = 0


class ScoreRequest(BaseModel):
    """``POST /score`` and ``/v1/score`` (vLLM's): ``text_1`` against each of ``text_2``, or
    pairwise when both are lists."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    text_1: str | list[str] | list[int] | list[list[int]]
    text_2: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0


class RerankRequest(BaseModel):
    """``POST /rerank``, ``/v1/rerank`` and ``/v2/rerank`` (vLLM's, Jina / Cohere style):
    ``documents`` ranked by their score against ``query``; ``top_n`` 0 or None keeps all."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    query: str | list[int]
    documents: list[str] | list[list[int]]
    top_n: int | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0


class ClassifyRequest(BaseModel):
    """``POST /classify`` and ``/v1/classify`` (vLLM's): class probabilities of each input
    from a sequence-classification model (``activation=false``: the raw logits)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None
    add_special_tokens: bool = True
    priority: int = 0


def pooling_params(
    req: EmbeddingRequest | ScoreRequest | RerankRequest | ClassifyRequest,
) -> PoolingParams:
    """The request's PoolingParams; out-of-range fields are a BadRequest naming them."""
    if isinstance(req, (ScoreRequest, RerankRequest)):  # a cosine: unit vectors, all features
        params = PoolingParams(normalize=True, truncate_prompt_tokens=req.truncate_prompt_tokens)
    elif isinstance(req, ClassifyRequest):
        params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens,
                               activation=req.activation)  # fmt: skip
    else:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)  # fmt: skip
    try:
        params.validate()
    except ValueError as err:
        raise BadRequest(str(err), param=_param_of(str(err))) from None
    return params


async def read_request(request: Any, model_cls: type[BaseModel]) -> Any:
    """Read, parse and validate an HTTP request's JSON body within the app's limits
    (``app.state.settings.limits``): 415, 413 or 400 before any work."""
    settings = getattr(request.app.state, "settings", None)
    limits = getattr(settings, "limits", None) or RequestLimits()
    return parse_request(await read_body(request, limits), model_cls, limits.max_json_depth)


def parse_request(
    raw: bytes, model_cls: type[BaseModel], max_depth: int = RequestLimits.max_json_depth
) -> Any:
    """Parse and validate a JSON body; any problem is a BadRequest naming the field."""
    try:  # strict JSON: NaN and Infinity are not JSON, and an echoed field could not be sent
        data = json.loads(raw, parse_constant=_not_json, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"malformed JSON body: {err}") from None
    except RecursionError:  # nested deeper than the interpreter's recursion limit
        raise BadRequest(f"the JSON body is nested deeper than {max_depth} levels") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    if json_depth(data, stop_after=max_depth) > max_depth:
        # later steps (templates, grammars, json.dumps) recurse over what the body holds
        raise BadRequest(f"the JSON body is nested deeper than {max_depth} levels")
    req = validate_request(data, model_cls)
    # fields a request model hands on to another one (``passthrough``) are not unknown
    unknown = set(req.model_extra or ()) - getattr(model_cls, "passthrough", frozenset())
    if unknown:
        logger.warning("ignoring unknown request fields: %s", sorted(unknown))
    return req


def _not_json(name: str) -> Any:
    """json.loads' hook for NaN, Infinity and -Infinity, which RFC 8259 does not allow."""
    raise BadRequest(f"malformed JSON body: {name} is not a JSON value")


def _finite_float(text: str) -> float:
    """json.loads' hook for a number with a fraction or exponent: refused if it overflows."""
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"malformed JSON body: the number {text[:32]} is out of range")
    return value


def json_depth(value: Any, stop_after: int) -> int:
    """How deep ``value``'s lists and objects nest (a scalar is 0), counted without recursion;
    the count stops once it passes ``stop_after``."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, todo = 0, [(value, 1)]
    while todo and deepest <= stop_after:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        todo.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def validate_request(data: dict[str, Any], model_cls: type[BaseModel]) -> Any:
    """``data`` as a ``model_cls``, types checked strictly (no "yes" for true, no 2.0 for 2, as
    in vLLM); a BadRequest naming the first bad field."""
    try:
        return model_cls.model_validate(data, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(p) for p in first["loc"]]
        param = loc[0] if loc else None
        got = repr(first.get("input"))[:80] if first["type"] != "missing" else "nothing"
        raise BadRequest(f"invalid '{param}': {first['msg']} (got {got})", param=param) from None


def _reject_unsupported(req: _GenerationRequest) -> None:
    """Fields we parse but cannot honour yet: refuse rather than silently ignore them."""
    checks: list[tuple[str, bool]] = []
    if isinstance(req, CompletionRequest):
        checks += [("suffix", req.suffix is not None)]
    for name, bad in checks:
        if bad:
            raise BadRequest(f"'{name}' is not supported by this server yet", param=name)


def _param_of(message: str) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be ...")."""
    word = message.split(" ", 1)[0]
    return word if word in {f.name for f in dataclasses.fields(SamplingParams)} else None


def check_counts(req: _GenerationRequest, limits: RequestLimits) -> None:
    """Refuse more stop strings, bad words or logit-bias entries than ``limits`` allow (each is
    work in every step of every sequence)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    counted = {"stop": stops, "bad_words": req.bad_words or []}
    for name, items in counted.items():
        if len(items) > limits.max_stop_strings:
            raise BadRequest(
                f"{name} has {len(items)} entries; this server takes at most "
                f"{limits.max_stop_strings} (--max-stop-strings)",
                param=name,
            )
    for name, items in counted.items():
        longest = max(map(len, items), default=0)
        if longest > limits.max_stop_string_chars:
            raise BadRequest(
                f"{name} has an entry of {longest} characters; this server takes at most "
                f"{limits.max_stop_string_chars} (--max-stop-string-chars)",
                param=name,
            )
    if len(req.logit_bias or {}) > limits.max_logit_bias:
        raise BadRequest(
            f"logit_bias has {len(req.logit_bias or {})} entries; this server takes at most "
            f"{limits.max_logit_bias} (--max-logit-bias)",
            param="logit_bias",
        )


def sampling_params(
    req: _GenerationRequest,
    max_logprobs: int,
    defaults: Mapping[str, Any] | None = None,
    forced: StructuredOutputsParams | None = None,
    limits: RequestLimits | None = None,
) -> SamplingParams:
    """The request's SamplingParams, ``n`` included (the engine gives choice i seed + i).
    ``defaults`` (the model's generation_config.json) fill the sampling fields it leaves unset;
    ``forced`` is a constraint the server adds (tool calls), exclusive of the request's own;
    ``limits`` bound the request's lists (default: RequestLimits())."""
    _reject_unsupported(req)
    check_counts(req, limits or RequestLimits())
    recommended = dict(defaults or {})
    default_max_tokens = recommended.pop("max_tokens", None)  # None: up to max_model_len
    if not 1 <= req.n <= MAX_N:
        raise BadRequest(f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    if req.best_of is not None and not req.n <= req.best_of <= MAX_N:
        raise BadRequest(
            f"best_of must be between n ({req.n}) and {MAX_N}, got {req.best_of}", param="best_of"
        )
    if req.stream and (req.best_of or req.n) > req.n:  # chunks would change choice mid-stream
        raise BadRequest("best_of > n is not available when stream is true", param="best_of")
    samples = max(req.n, req.best_of or 0)
    if req.seed is not None and req.seed + samples - 1 > INT64[1]:  # sample i uses seed + i
        raise BadRequest(
            f"seed + {samples - 1} (the last sample's seed) must stay within int64, got seed "
            f"{req.seed}",
            param="seed",
        )
    max_tokens, max_tokens_field = requested_max_tokens(req)
    if isinstance(req, ChatCompletionRequest):
        logprobs = _chat_logprobs(req, max_logprobs)
    else:
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= max_logprobs:
            raise BadRequest(f"logprobs must be in [0, {max_logprobs}]", param="logprobs")
        if req.echo and max_tokens == 0:  # score the prompt only: run one step, show no output
            max_tokens = 1
    prompt_logprobs = _prompt_logprobs(req, logprobs, max_logprobs)
    if max_tokens_unset(req):
        max_tokens = default_max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(
            f"{max_tokens_field} must be at least 1, got {max_tokens}", param=max_tokens_field
        )
    try:
        return SamplingParams(
            n=req.n,
            best_of=req.best_of,
            seed=req.seed,  # within int64 (checked); torch takes seed + i up to 2**64 - 1
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            guided_decoding=_guided_decoding(req, forced),
            **_shaping(req, recommended),
        )
    except ValueError as err:
        raise BadRequest(str(err), param=_param_of(str(err))) from None


def requested_max_tokens(req: _GenerationRequest) -> tuple[int | None, str]:
    """(the output length the request asks for, the field it came from): chat's
    ``max_completion_tokens`` wins over its older ``max_tokens``."""
    chat_limit = getattr(req, "max_completion_tokens", None)
    if chat_limit is not None:
        return chat_limit, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def max_tokens_unset(req: _GenerationRequest) -> bool:
    """True when the request leaves its output length to the server (chat: neither max_tokens
    nor max_completion_tokens; completions: ``"max_tokens": null``)."""
    return requested_max_tokens(req)[0] is None


def _shaping(req: _GenerationRequest, recommended: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields the request sets, laid over the model's recommended ones; a field
    neither sets keeps SamplingParams' own default."""
    asked = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
    }  # fmt: skip
    return {**recommended, **{k: v for k, v in asked.items() if v is not None}}


def _prompt_logprobs(
    req: _GenerationRequest, logprobs: int | None, max_logprobs: int
) -> int | None:
    """vLLM's ``prompt_logprobs``; without it, completions' echo with logprobs scores the prompt
    with ``logprobs`` alternatives (as vLLM and OpenAI did)."""
    k = req.prompt_logprobs
    if k is not None and not 0 <= k <= max_logprobs:
        raise BadRequest(f"prompt_logprobs must be in [0, {max_logprobs}]", param="prompt_logprobs")
    if k and req.stream:  # streamed chunks have no field for them (vLLM refuses too; 0 is dropped)
        raise BadRequest(
            "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
        )
    if k is None or req.stream:
        return logprobs if isinstance(req, CompletionRequest) and req.echo else None
    return k


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    out = {}
    for token, bias in (raw or {}).items():
        try:
            out[int(token)] = bias
        except ValueError:
            raise BadRequest(
                f"logit_bias keys must be token ids, got {token!r}", param="logit_bias"
            ) from None
    return out or None


def _guided_decoding(
    req: _GenerationRequest, forced: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """vLLM's structured_outputs (or its older guided_* fields), or OpenAI's response_format
    (json_object / json_schema), or ``forced``; at most one constraint in all."""
    fields = {
        "json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
        "grammar": req.guided_grammar,
    }  # fmt: skip
    structured = req.structured_outputs or {}
    unknown = sorted(set(structured) - {*fields, "json_object"})
    if unknown:
        raise BadRequest(
            f"structured_outputs: unsupported field(s) {unknown}; paged-llm takes json, regex, "
            "choice, grammar and json_object",
            param="structured_outputs",
        )
    for key, value in structured.items():
        if value is not None and fields.get(key) is not None:
            raise BadRequest(f"both structured_outputs.{key} and guided_{key} are set")
        if value is not None:
            fields[key] = value
    fmt = getattr(req, "response_format", None) or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        fields["json_object"] = True
    elif kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise BadRequest(
                "response_format json_schema needs json_schema.schema (an object)",
                param="response_format",
            )
        fields["json"] = schema
    elif kind != "text":
        raise BadRequest(
            f"response_format type must be text, json_object or json_schema, got {kind!r}",
            param="response_format",
        )
    given = {k: v for k, v in fields.items() if v is not None}
    if forced is not None:
        if given:
            raise BadRequest(
                'tool_choice "required" or a named function constrains the output already; '
                "drop response_format / structured_outputs",
                param="tool_choice",
            )
        return forced
    if not given:
        return None
    try:
        return StructuredOutputsParams(**given)
    except ValueError as err:
        raise BadRequest(str(err), param="response_format" if fmt else None) from None


def _chat_logprobs(req: ChatCompletionRequest, max_logprobs: int) -> int | None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= max_logprobs:
            raise BadRequest(f"top_logprobs must be in [0, {max_logprobs}]", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """Split ``prompt`` (text, token ids, or a batch of either) into single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts for a chat template; text parts are joined with newlines."""
    if not messages:
        raise BadRequest("messages must contain at least one message", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if msg.role not in MESSAGE_ROLES:
            raise BadRequest(
                f"messages[{i}].role must be one of {list(MESSAGE_ROLES)}, got '{msg.role}'",
                param=f"messages.{i}.role",
            )
        content = msg.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"messages[{i}].content: only text parts are supported",
                        param=f"messages.{i}.content",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": msg.role, "content": content or ""}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            entry["tool_calls"] = msg.tool_calls
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        out.append(entry)
    return out
