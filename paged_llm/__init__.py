"""paged-llm: a readable research implementation of vLLM and PagedAttention."""

from paged_llm.beam_search import BeamSearchOutput, BeamSearchParams
from paged_llm.config import CacheConfig, EngineArgs, EngineConfig, ModelConfig, SchedulerConfig
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.llm import LLM
from paged_llm.outputs import CompletionOutput, Logprob, RequestOutput
from paged_llm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "BeamSearchOutput",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "GuidedDecodingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
]
