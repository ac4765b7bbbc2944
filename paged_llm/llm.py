"""``LLM``: vLLM's offline entry point (``LLM(model=...).generate(prompts, params)``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from paged_llm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from paged_llm.config import EngineConfig
from paged_llm.engine.chat import render_chat
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.lora.request import LoRARequest
from paged_llm.metrics.reader import Metric, from_families
from paged_llm.metrics.serving_stats import RequestStats, engine_gauges
from paged_llm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from paged_llm.pooling.scoring import (
    check_cross_encoder,
    cosine_scores,
    cross_encoder_input,
    score_pairs,
)
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import RequestOutputKind, SamplingParams


def as_prompt_list(prompts: Any) -> list[Any]:
    """A batch of prompts: one prompt (text, a prompt dict or a list of token ids) is wrapped."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


def per_prompt(value: Any, count: int, what: str) -> list[Any]:
    """One value for every prompt: a single value (or None) repeated, or a list of ``count``."""
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"got {len(value)} {what} for {count} prompts")
    return list(value)


class LLM:
    """Offline batched generation over the paged engine."""

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        self._start(LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """Build from an EngineConfig (e.g. composed by Hydra)."""
        llm = cls.__new__(cls)
        llm._start(LLMEngine(config))
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        # the server's counters and histograms, fed with finished outputs, for get_metrics
        self._metrics = RequestStats(engine.config.model.model)

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the server's metrics for this engine (vLLM's ``LLM.get_metrics``):
        Counter, Gauge, Histogram and, for accepted drafts by position, Vector objects."""
        return from_families(self._metrics.families(engine_gauges(self.llm_engine)))

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (also done on garbage collection and at exit)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over the paged engine (beams fork and drop shared block tables);
        ``lora_request``: one adapter, or one per prompt (with ``enable_lora``)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        loras = per_prompt(lora_request, len(prompts), "LoRA requests")
        return beam_search(self.llm_engine, prompts, params, lora_requests=loras)

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None if it has none)."""
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, so the next run starts cold (True once done)."""
        return self.llm_engine.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> int:  # (name, torch.Tensor)
        """Update the model in place from Hugging-Face-named tensors (any part of a checkpoint,
        e.g. ``hf_model.state_dict().items()`` after an RL step), between generate calls; the
        prefix cache is dropped. Returns the number of tensors written."""
        return self.llm_engine.load_weights(weights)

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory between generate calls (needs ``enable_sleep_mode=True``):
        level 1 offloads the weights to CPU memory and discards the KV cache; level 2 discards
        both, for ``load_weights`` to write new weights after ``wake_up``."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed: ``tags`` "weights" and/or "kv_cache" (None: both)."""
        self.llm_engine.wake_up(tags)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a ``ModelRunner`` method (by name) or ``method(runner, *args, **kwargs)`` on
        every tensor-parallel rank; the results in rank order."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on every rank's model; the results in rank order."""
        return self.llm_engine.apply_model(func)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's recommended settings (its generation_config.json,
        unless ``generation_config="vllm"``); what ``generate`` uses when given none."""
        return self.llm_engine.generation_defaults.default_sampling_params()

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        a list of them, rendered with the tokenizer's chat template (or ``chat_template``);
        ``tools`` (OpenAI function definitions) go to the template too, as in vLLM."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text, ids = render_chat(
                    self.llm_engine.tokenizer, list(conversation), chat_template,
                    add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
                )  # fmt: skip
            except ValueError as err:
                raise ValueError(f"conversation {i}: {err}") from err
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; return one RequestOutput per prompt, in order.
        ``lora_request`` (one, or one per prompt, with ``enable_lora=True``): the LoRA adapter.
        ``priority`` (one per prompt, with ``scheduling_policy="priority"``): smaller runs sooner.

        Every prompt is validated before any is run: a bad one raises ValueError naming its
        index, and nothing is left queued.
        """
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts"
                )
        # only the end is read (as in vLLM)
        params_list = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                       if isinstance(p, SamplingParams) else p for p in params_list]  # fmt: skip
        return self._run(prompts, params_list, use_tqdm, lora_request, priority, "generate")

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run a pooling model (``runner="pooling"``) over every prompt; return each one's
        pooled hidden states (``outputs.data``: [H], or [L, H] with pooling_type ALL)."""
        prompts = as_prompt_list(prompts)
        params_list = per_prompt(pooling_params, len(prompts), "PoolingParams")
        params_list = [p if p is not None else PoolingParams() for p in params_list]
        if truncate_prompt_tokens is not None:  # vLLM's argument, laid over each request's
            params_list = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                           for p in params_list]  # fmt: skip
        return self._run(prompts, params_list, use_tqdm, lora_request, None, "encode")

    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``, a list of floats) from a pooling
        model; its pooling must give one vector per prompt (not ALL)."""
        if self.llm_engine.pooler is not None:
            if self.llm_engine.pooler.head is not None:
                raise ValueError("this is a sequence-classification model: use LLM.classify")
            self.llm_engine.pooler.require_one_vector("embed")
        outputs = self.encode(prompts, pooling_params, use_tqdm, lora_request,
                              truncate_prompt_tokens)  # fmt: skip
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of each prompt (``outputs.probs``) from a sequence-classification
        model (a ``*ForSequenceClassification`` checkpoint run with ``runner="pooling"``)."""
        pooler = self.llm_engine.pooler
        if pooler is None or pooler.head is None:
            raise ValueError(
                "LLM.classify needs a sequence-classification model (a *ForSequenceClassification "
                "checkpoint, runner='pooling'); this one "
                + ("embeds: use LLM.embed" if pooler is not None else "generates")
            )
        outputs = self.encode(prompts, pooling_params, use_tqdm, lora_request,
                              truncate_prompt_tokens)  # fmt: skip
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        data_1: Any,
        data_2: Any,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: for embedding models the cosine similarity of each pair's
        embeddings; for a cross-encoder (a classifier with one label) the sigmoid of its logit
        on the pair tokenized together. One text against many (``data_1`` a single prompt), or
        pairwise (two lists of the same length)."""
        distinct, pairs = score_pairs(as_prompt_list(data_1), as_prompt_list(data_2))
        pooler = self.llm_engine.pooler
        if pooler is not None and pooler.head is not None:
            return self._cross_encode(distinct, pairs, use_tqdm, lora_request,
                                      truncate_prompt_tokens)  # fmt: skip
        if pooler is not None:
            pooler.require_one_vector("score")
        params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
        outs = self.encode(distinct, params, use_tqdm, lora_request)  # each input once
        values = cosine_scores([o.outputs.data for o in outs], pairs)
        return [
            ScoringRequestOutput(f"score-{i}", ScoringOutput(value),
                                 outs[a].prompt_token_ids + outs[b].prompt_token_ids)
            for i, (value, (a, b)) in enumerate(zip(values, pairs))
        ]  # fmt: skip

    def _cross_encode(
        self,
        distinct: list[Any],
        pairs: list[tuple[int, int]],
        use_tqdm: bool,
        lora_request: LoRARequest | None,
        truncate_prompt_tokens: int | None,
    ) -> list[ScoringRequestOutput]:
        """Score each pair as one input of a one-label classifier (a cross-encoder)."""
        check_cross_encoder(self.llm_engine.pooler.head.num_labels, "LLM.score", "LLM.classify")
        tokenizer = self.llm_engine.tokenizer
        joined = [cross_encoder_input(distinct[a], distinct[b], tokenizer) for a, b in pairs]
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        outs = self.encode(joined, params, use_tqdm, lora_request)
        return [
            ScoringRequestOutput(
                f"score-{i}", ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids
            )  # fmt: skip
            for i, o in enumerate(outs)
        ]

    def _run(
        self,
        prompts: list[Any],
        params_list: list[Any],
        use_tqdm: bool,
        lora_request: Any,
        priority: Sequence[int] | None,
        desc: str,
    ) -> list[Any]:
        """Validate every prompt (a bad one raises naming its index, leaving nothing queued),
        queue them all, step until each has finished; their final outputs, in prompt order."""
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = per_prompt(lora_request, len(prompts), "LoRA requests")
        engine = self.llm_engine
        groups = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                rid = f"offline-{i}-{id(self)}"
                group = engine.inputs.make_request(
                    rid, prompt, params, priority=priorities[i], lora_request=loras[i]
                )
                groups.append(group)
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from err
        for g in groups:
            engine.outputs.add(g)
        index = {g.request_id: i for i, g in enumerate(groups)}
        results: list[Any] = [None] * len(groups)
        try:
            with tqdm(total=len(groups), desc=desc, disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished and out.request_id in index:
                            results[index[out.request_id]] = out
                            self._count_finished(out)
                            bar.update(1)
        except BaseException:  # (a bug, or Ctrl-C): leave the engine empty for the next call
            engine.abort_request([g.request_id for g in groups])
            raise
        return [r for r in results if r is not None]

    def _count_finished(self, out: RequestOutput | PoolingRequestOutput) -> None:
        """Add a finished request to the counters behind ``get_metrics`` (as the server
        counts it: the prompt once, every sample's tokens and finish reason)."""
        generated = [] if isinstance(out, PoolingRequestOutput) else out.outputs
        self._metrics.record_tokens(
            len(out.prompt_token_ids), sum(len(c.token_ids) for c in generated)
        )
        for c in generated:
            self._metrics.record_finish_reason(c.finish_reason)
        self._metrics.record_latencies(out.metrics)
