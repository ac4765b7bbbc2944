"""From a user's prompt and parameters to validated scheduler Requests: every check runs, and
every per-sample object (text keeper, stop strings, grammar guide, adapter) is made, before
anything is queued, so bad input raises ValueError and changes nothing."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch

from paged_llm.core.request import Request
from paged_llm.engine.inputs import to_token_ids, truncate_prompt, validate_token_ids
from paged_llm.engine.reasoning import reasoning_parser
from paged_llm.engine.request_group import RequestGroup, Tracked
from paged_llm.engine.sleep_mode import SleepState
from paged_llm.engine.stop_strings import StopStringChecker
from paged_llm.engine.structured_output import StructuredOutputCompiler
from paged_llm.engine.token_texts import TokenTexts
from paged_llm.lora.request import LoRARequest
from paged_llm.pooling_params import PoolingParams
from paged_llm.runner.logits_processors import bad_words_token_ids
from paged_llm.sampling_params import SamplingParams
from paged_llm.utils.checks import is_int


class InputProcessor:
    """Validates requests against one engine's model, tokenizer, scheduler and features."""

    def __init__(
        self,
        worker: Any,  # engine.worker.Worker: the model's facts, pooler, LoRA, parallel ranks
        scheduler: Any,
        texts: TokenTexts,
        generation_defaults: Any,  # engine.generation_config.GenerationDefaults
        eos_token_id: int | None,
        load_lora: Callable[[LoRARequest], bool],  # loads an adapter on every rank
        clock: Callable[[], float],
        sleep_state: SleepState,  # sleep mode: no request while the engine's memory is asleep
    ) -> None:
        self.worker, self.scheduler, self.texts = worker, scheduler, texts
        self.generation_defaults, self.eos_token_id = generation_defaults, eos_token_id
        self.load_lora, self.clock, self.sleep_state = load_lora, clock, sleep_state
        self._ids = itertools.count()  # ids of requests added without one
        self.vocab_size, self.max_model_len = worker.vocab_size, worker.max_model_len
        self._structured: StructuredOutputCompiler | None = None  # built on first guided request
        # with a reasoning parser, grammars wait for the end of the thought (tags as token ids)
        name = worker.config.model.reasoning_parser
        self.reasoning = reasoning_parser(name) if name else None
        self.reasoning_tags = self.reasoning.tag_ids(texts.tokenizer) if self.reasoning else None

    def make_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestGroup:
        """Validate a prompt and its parameters; the request group to queue. Raise ValueError
        before any work is done (EngineAsleepError while sleep mode has the engine's memory)."""
        self.sleep_state.check_awake()
        parallel = self.worker.parallel
        if parallel is not None and not parallel.is_driver:
            raise ValueError(
                f"tensor-parallel rank {parallel.group.rank} only runs the model; "
                "submit requests on rank 0"
            )
        if self.worker.pooler is not None or isinstance(params, PoolingParams):
            return self._pooling_request(
                request_id, prompt, params, arrival_time, priority, lora_request
            )
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        self.scheduler.check_group_size(params.best_of, "n/best_of")  # before any per-sample work
        self._check_priority(priority)
        lora_id = self._check_lora(lora_request)
        text, ids = self._prompt_ids(prompt, params.truncate_prompt_tokens)
        validate_token_ids(ids, self.vocab_size, self.max_model_len)
        self._check_sampling(params)
        # the checkpoint's other EOS ids (generation_config.json) end it too
        params = self.generation_defaults.add_eos_stops(params, self.eos_token_id)
        bad_words = bad_words_token_ids(params.bad_words or [], self.texts.tokenizer)
        guides = self._guides(params, ids)
        arrival = self.clock() if arrival_time is None else arrival_time
        members = []
        for i in range(params.best_of):
            # each sample draws its own random stream; a user seed stays reproducible
            p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
            detokenizer = self.texts.detokenizer_for(p)
            stops = StopStringChecker(detokenizer, p) if detokenizer and p.stop else None
            request = Request(
                request_id=request_id if i == 0 else f"{request_id}#{i}",
                prompt_token_ids=ids,
                sampling_params=p,
                arrival_time=arrival,
                priority=priority,
                lora_int_id=lora_id,
                eos_token_id=self.eos_token_id,
                max_model_len=self.max_model_len,
                group_id=request_id if params.best_of > 1 else None,
                bad_words_token_ids=bad_words,
                guide=guides[i],
                stop_strings=stops,
            )
            members.append(Tracked(request, text, logprobs=[] if p.logprobs is not None else None,
                                   detokenizer=detokenizer, stop_strings=stops))  # fmt: skip
        self.scheduler.check_group_fits([t.request for t in members], "n/best_of")
        prompt_lps = None if params.prompt_logprobs is None else [None] * len(ids)
        return RequestGroup(request_id, members, unforked=[], prompt_logprobs=prompt_lps,
                            lora_request=lora_request)  # fmt: skip

    def request_id(self, request_id: str | None, taken: Collection[str]) -> str:
        """The id of a request being added: the next number for None; one in ``taken``
        refused."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in taken:
            raise ValueError(f"request id '{request_id}' is already in use")
        return request_id

    def _check_sampling(self, params: SamplingParams) -> None:
        """Token ids and top-k counts within the vocabulary; stop strings need a tokenizer."""
        if params.stop and self.texts.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer, and this model has none: use stop_token_ids"
            )
        for name, ids_ in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", params.logit_bias or {}),
                           ("allowed_token_ids", params.allowed_token_ids or [])):  # fmt: skip
            outside = [t for t in ids_ if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(
                    f"{name} {outside[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        for name in ("logprobs", "prompt_logprobs"):  # top-k alternatives come from the vocab
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} exceeds the vocabulary size {self.vocab_size}")

    def _guides(self, params: SamplingParams, prompt_ids: list[int]) -> list[Any]:
        """A fresh grammar guide per sample (None each without guided_decoding); with a
        reasoning parser each waits for the end of the thought."""
        guided = params.guided_decoding
        if not guided:
            return [None] * params.best_of
        if self._structured is None:  # xgrammar is optional: imported on first use
            self._structured = StructuredOutputCompiler(
                self.texts.tokenizer, self.vocab_size, self.eos_token_id
            )
        guides = [self._structured.guide(guided) for _ in range(params.best_of)]
        if self.reasoning is not None:
            guides = [self.reasoning.gate(g, prompt_ids, self.reasoning_tags) for g in guides]
        if params.allowed_token_ids is not None:
            first = guides[0].allowed()  # [V] bool: the grammar's possible first tokens
            if not bool(first[torch.tensor(params.allowed_token_ids)].any()):
                raise ValueError(
                    "allowed_token_ids and guided_decoding leave no token to start with: the "
                    "grammar accepts none of the allowed tokens first"
                )
        return guides

    def _pooling_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        arrival_time: float | None,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> RequestGroup:
        """Validate a pooling (embedding) request."""
        pooler = self.worker.pooler
        if pooler is None:
            raise ValueError(
                "got PoolingParams, but this engine generates; start it with runner='pooling' "
                "to embed"
            )
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"this is a pooling model (runner='pooling'): expected PoolingParams, got "
                f"{type(params).__name__}; use LLM.embed / LLM.encode"
            )
        params.validate()
        if pooler.head is not None and params.dimensions is not None:
            raise ValueError("dimensions applies to embeddings, not to a classifier's labels")
        self._check_dimensions(params)
        self._check_priority(priority)
        lora_id = self._check_lora(lora_request)
        text, ids = self._prompt_ids(prompt, params.truncate_prompt_tokens)
        validate_token_ids(ids, self.vocab_size, self.max_model_len, generates=False)
        request = Request(
            request_id=request_id, prompt_token_ids=ids, sampling_params=SamplingParams(),
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority, lora_int_id=lora_id, max_model_len=self.max_model_len,
            pooling_params=params, pool_all_tokens=pooler.method.needs_all_tokens,
        )  # fmt: skip
        return RequestGroup(request_id, [Tracked(request, text)], unforked=[],
                            lora_request=lora_request)  # fmt: skip

    def _prompt_ids(self, prompt: Any, keep: int | None) -> tuple[str | None, list[int]]:
        """The prompt's (text, token ids), cut to its last ``keep`` ids (truncate_prompt_tokens)
        before any length check; the text of a cut prompt is its kept ids decoded."""
        tokenizer = self.texts.tokenizer
        text, ids = to_token_ids(prompt, tokenizer)
        kept = truncate_prompt(ids, keep)
        if len(kept) < len(ids):
            return (tokenizer.decode(kept) if tokenizer is not None else None), kept
        return text, ids

    def _check_dimensions(self, params: PoolingParams) -> None:
        """PoolingParams.dimensions only for Matryoshka models, and at most the hidden size."""
        if params.dimensions is None:
            return
        hf = self.worker.hf_config
        matryoshka = getattr(hf, "is_matryoshka", False) or getattr(
            hf, "matryoshka_dimensions", None
        )
        if not matryoshka:
            raise ValueError(
                "dimensions is only for Matryoshka embedding models (config.json: "
                "is_matryoshka or matryoshka_dimensions); this model is not one"
            )
        allowed = getattr(hf, "matryoshka_dimensions", None)
        if allowed and params.dimensions not in allowed:
            raise ValueError(f"dimensions={params.dimensions} is not one of {allowed}")
        if params.dimensions > hf.hidden_size:
            raise ValueError(f"dimensions={params.dimensions} exceeds the hidden size "
                             f"{hf.hidden_size}")  # fmt: skip

    def _check_lora(self, lora_request: LoRARequest | None) -> int:
        """The request's adapter id (0: none), its adapter checked and loaded on first use."""
        if lora_request is None:
            return 0
        if self.worker.lora is None:
            raise ValueError("got a lora_request, but LoRA is not enabled; use enable_lora=True")
        self.load_lora(lora_request)
        return lora_request.lora_int_id

    def _check_priority(self, priority: int) -> None:
        if not is_int(priority):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and not self.scheduler.queue.orders_by_priority:
            raise ValueError(
                f"got priority {priority}, but scheduling_policy is "
                f"'{self.scheduler.queue.name}'; use scheduling_policy='priority'"
            )
