"""paged-llm: a readable research implementation of vLLM and PagedAttention.

The public names are imported on first use (PEP 562), so the plain-Python bookkeeping
(``paged_llm.core``: blocks, allocators, scheduler) and the simulator import without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "paged_llm.llm",
    "BeamSearchParams": "paged_llm.beam_search",
    "BeamSearchOutput": "paged_llm.beam_search",
    "LLMEngine": "paged_llm.engine.llm_engine",
    "AsyncLLMEngine": "paged_llm.serve.async_llm_engine",
    "AsyncEngineArgs": "paged_llm.serve.async_llm_engine",
    "EngineArgs": "paged_llm.config",
    "SamplingParams": "paged_llm.sampling_params",
    "RequestOutputKind": "paged_llm.sampling_params",
    "GuidedDecodingParams": "paged_llm.sampling_params",
    "StructuredOutputsParams": "paged_llm.sampling_params",
    "RequestOutput": "paged_llm.outputs",
    "PoolingParams": "paged_llm.pooling_params",
    "PoolingRequestOutput": "paged_llm.outputs",
    "EmbeddingRequestOutput": "paged_llm.outputs",
    "ClassificationRequestOutput": "paged_llm.outputs",
    "ScoringRequestOutput": "paged_llm.outputs",
    "CompletionOutput": "paged_llm.outputs",
    "Logprob": "paged_llm.outputs",
    "EngineConfig": "paged_llm.config",
    "ModelConfig": "paged_llm.config",
    "CacheConfig": "paged_llm.config",
    "SchedulerConfig": "paged_llm.config",
    "ModelRegistry": "paged_llm.models.registry",
}
__all__ = [  # the names of _EXPORTS, spelled out so linters and IDEs see them
    "LLM",
    "BeamSearchParams",
    "BeamSearchOutput",
    "LLMEngine",
    "AsyncLLMEngine",
    "AsyncEngineArgs",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ModelRegistry",
]

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from paged_llm.beam_search import BeamSearchOutput, BeamSearchParams
    from paged_llm.config import (
        CacheConfig,
        EngineArgs,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )
    from paged_llm.engine.llm_engine import LLMEngine
    from paged_llm.llm import LLM
    from paged_llm.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from paged_llm.pooling_params import PoolingParams
    from paged_llm.sampling_params import (
        GuidedDecodingParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )
    from paged_llm.serve.async_llm_engine import AsyncEngineArgs, AsyncLLMEngine


# The Hydra configs' typed schemas and --help are registered by hydra_plugins/paged_llm_configs,
# which Hydra imports before composing any config: importing paged_llm does not import hydra.


def __getattr__(name: str) -> Any:
    """Import a public name from its module the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_llm' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """Module attributes plus the lazily imported public names."""
    return sorted(set(globals()) | set(__all__))
