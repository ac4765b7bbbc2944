"""SamplingParams with vLLM's names and defaults; validated on construction."""

from __future__ import annotations

import copy
import enum
import inspect
import json as _json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paged_llm.utils.checks import is_int

GREEDY_BELOW_TEMPERATURE = 1e-5


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step()`` returns for a running request (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output (for streaming)
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, with vLLM's fields; set exactly one. (vLLM's current
    name; ``GuidedDecodingParams`` is the older one, kept as an alias.)"""

    json: str | dict | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # EBNF (GBNF dialect)
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]  # fmt: skip
        if len(given) != 1:
            raise ValueError(
                "guided decoding takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("guided choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"guided json schema is not valid JSON: {err}") from None

    def json_text(self) -> str:
        """The JSON schema as text."""
        return self.json if isinstance(self.json, str) else _json.dumps(self.json)

    def key(self) -> tuple[str, str]:
        """(kind, spec): what identifies the compiled grammar."""
        if self.json is not None:
            return "json schema", self.json_text()
        if self.json_object:
            return "json object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        return "grammar", str(self.grammar)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before v0.12


@dataclass
class SamplingParams:
    """How to sample one request's output (temperature 0 means greedy)."""

    n: int = 1
    # sample best_of sequences, return the n with the highest cumulative logprob (vLLM V0's
    # best_of; None means n)
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables top-k
    min_p: float = 0.0
    # OpenAI's penalties on tokens already in the output (count and presence), in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # > 1 discourages, < 1 encourages every token of the prompt and the output (CTRL's form)
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never complete one of these (needs a tokenizer)
    guided_decoding: GuidedDecodingParams | None = None  # structured output (needs xgrammar)
    # vLLM's current name for the same thing (its older guided_decoding was removed in v0.12);
    # either may be given, and both then hold the same object
    structured_outputs: StructuredOutputsParams | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (plus the sampled)
    prompt_logprobs: int | None = None  # the same for each prompt token (raw model logprobs)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: spaces around special tokens in the text; only slow (Python) tokenizers use it,
    # fast ones (every tokenizer this project builds) decode the same either way
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's)
    # vLLM's user logits processors, applied first, per sequence: fn(output_ids, logits) or
    # fn(prompt_ids, output_ids, logits), logits a [vocab] float32 row; returns the new row
    logits_processors: list[Callable[..., Any]] | None = None
    detokenize: bool = True  # False: leave the output text empty (token ids only)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None  # vLLM's: free-form data for your own processors

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.logits_processors = list(self.logits_processors) if self.logits_processors else None
        if self.best_of is None:
            self.best_of = self.n
        both = self.structured_outputs is not None and self.guided_decoding is not None
        if both and self.structured_outputs is not self.guided_decoding:
            raise ValueError("give structured_outputs or guided_decoding, not both")
        self.guided_decoding = self.structured_outputs = (
            self.guided_decoding or self.structured_outputs
        )
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n}")
        if not is_int(self.best_of) or self.best_of < self.n:
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("top_k", "max_tokens", "min_tokens"):  # counts: a float fails late
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        # numbers used as floats: an int too large for a float fails here, not in a step
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            setattr(self, name, _as_float(name, getattr(self, name)))
        if not 0 <= self.temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            # torch generators take 64-bit seeds; sample i of n uses seed + i
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for token, bias in (self.logit_bias or {}).items():
            self.logit_bias[token] = bias = _as_float("logit_bias values", bias)
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for {token}"
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            bad = [t for t in self.allowed_token_ids if not is_int(t) or t < 0]
            if bad:
                raise ValueError(f"allowed_token_ids must be token ids (ints >= 0), got {bad[:5]}")
        if self.guided_decoding is not None and not isinstance(
            self.guided_decoding, GuidedDecodingParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words or []):
            raise ValueError("bad_words must be non-empty strings")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or k < 1):
            raise ValueError(f"truncate_prompt_tokens must be None or an integer >= 1, got {k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(map(is_int, self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        for fn in self.logits_processors or []:
            logits_processor_arity(fn)  # raises for anything but a 2- or 3-argument callable
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.output_kind is RequestOutputKind.DELTA and self.best_of > self.n:
            # the best n can change while the request runs; deltas could not follow them
            raise ValueError("best_of > n needs output_kind CUMULATIVE or FINAL_ONLY")
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids instead)")

    def clone(self) -> SamplingParams:
        """A deep copy that shares the logits processors (vLLM's: they may hold large state;
        a processor with its own ``clone()`` is cloned)."""
        processors = self.logits_processors or []
        memo = {id(fn): fn.clone() if hasattr(fn, "clone") else fn for fn in processors}
        return copy.deepcopy(self, memo)

    @property
    def tracks_logprobs(self) -> bool:
        """True when each sampled token's logprob is needed: asked for, or to rank best_of."""
        return self.logprobs is not None or self.best_of > self.n

    @property
    def has_penalties(self) -> bool:
        """True when the output history changes the logits (any of the three penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def needs_logits_processing(self, num_output_tokens: int) -> bool:
        """Whether ``runner.logits_processors.process_logits`` would change a row after
        ``num_output_tokens`` outputs (cheap, and asked here, so that most requests, which it
        would leave alone, never enter that module)."""
        return (
            num_output_tokens < self.min_tokens
            or bool(self.logits_processors)
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.has_penalties
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax decoding: temperature 0, or so close to it that logits
        divided by it would overflow (vLLM's threshold)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _as_float(name: str, value: Any) -> float:
    """``value`` as a float (ints and floats only; bools count as neither)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float ({str(value)[:20]}...)") from None


def logits_processor_arity(fn: Any) -> int:
    """2 (``fn(output_ids, logits)``) or 3 (``fn(prompt_ids, output_ids, logits)``), as vLLM
    tells them apart; ValueError for anything else."""
    if not callable(fn):
        raise ValueError(f"logits_processors must be callables, got {fn!r}")
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: vLLM's default form
        return 2
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_keywords = [p for p in parameters if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) not in (2, 3) or required_keywords:
        raise ValueError(
            "a logits processor takes (output_ids, logits) or (prompt_ids, output_ids, "
            f"logits), got {getattr(fn, '__name__', fn)!r}{inspect.signature(fn)}"
        )
    return len(positional)
