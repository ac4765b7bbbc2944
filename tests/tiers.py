"""Test tiers: every test file's default tier, applied as a pytest marker at collection.

A test's own tier marker (e.g. ``@pytest.mark.distributed`` on the one test of a file that
starts ranks) replaces its file's. ``make test-quick`` runs ``unit or engine`` without ``slow``;
``make test`` (and CI) runs every tier, slow tests included. A new test file must be listed here
(tests/test_tiers.py checks it), so its cost is chosen, not inherited.
"""

TIERS = ("unit", "engine", "serve", "distributed", "experiment")

# unit: one module at a time, no engine built (bookkeeping, kernels against their references);
# engine: builds an LLM / LLMEngine in this process; serve: an HTTP server or its ASGI app;
# distributed: starts tensor-parallel ranks; experiment: runs experiments/ or paper_repro/
# entry points (simulated figures, benchmarks' smoke runs).
FILE_TIERS = {
    "unit": [
        "test_async_scheduling",
        "test_attention_backend_api",
        "test_config_schemas",
        "test_core_allocators",
        "test_cpu_attention",
        "test_cpu_linear",
        "test_detokenizer",
        "test_elementwise_kernels",
        "test_host_inputs",
        "test_kernels",
        "test_kv_split",
        "test_lora_kernels",
        "test_machine_share",
        "test_memory_guard",
        "test_moe_kernels",
        "test_paged_features",
        "test_quant_layers",
        "test_sampler",
        "test_scheduler",
        "test_sim_fast_forward",
        "test_sim_metrics",
        "test_stop_conditions",
        "test_tiers",
        "test_verdicts",
        "test_workloads_arrivals",
        "test_workloads_traces",
    ],
    "engine": [
        "test_async_llm_engine",
        "test_async_output",
        "test_async_scheduling_engine",
        "test_batch_fuzz",
        "test_classification",
        "test_default_model",
        "test_eagle",
        "test_engine",
        "test_engine_core",
        "test_generation_config",
        "test_host_syncs",
        "test_kv_offload",
        "test_kv_transfer",
        "test_llm_metrics",
        "test_load_weights",
        "test_logits_processors",
        "test_lora",
        "test_merged_linear",
        "test_mixed_graphs",
        "test_models",
        "test_moe",
        "test_plugins",
        "test_pooling",
        "test_prompt_logprobs",
        "test_reading_path",
        "test_quant_checkpoint",
        "test_quant_kv_cache",
        "test_quant_methods",
        "test_reasoning",
        "test_sharing",
        "test_sleep_mode",
        "test_sliding_window",
        "test_spec",
        "test_stop_strings",
        "test_structured_output",
        "test_trained_models",
    ],
    "serve": [
        "test_serve_api",
        "test_serve_async_engine",
        "test_serve_beam_search",
        "test_serve_cli",
        "test_serve_disagg",
        "test_serve_fuzz",
        "test_serve_hardening",
        "test_serve_limits",
        "test_serve_responses",
        "test_serve_sleep",
        "test_serve_tools",
        "test_tool_calls",
    ],
    "distributed": ["test_tensor_parallel"],
    "experiment": [
        "test_all_figures",
        "test_beam_sharing_experiment",
        "test_capacity_bound",
        "test_capacity_plan",
        "test_figure_sweeps",
        "test_gpu_check",
        "test_kernel_compile",
        "test_paper_repro",
        "test_paper_repro_real",
        "test_paper_repro_seeds",
        "test_paper_repro_sharing",
        "test_priority_scheduling",
        "test_quant_eval",
        "test_real_executor_sharing",
        "test_sim",
        "test_sim_disagg",
        "test_sim_paper_fit",
        "test_spec_decode_experiment",
        "test_sweeps",
        "test_throughput_bench",
        "test_validate_sim",
    ],
}


# Slow (``make test-quick`` leaves them out): a node-id prefix each, a whole file where its
# fixture is the cost. Measured by ``pytest --durations=0`` over the quick tiers (2026-12-06,
# 2 loaded cores): each took 20 s or more there, together 44% of the quick tiers' time. The
# EAGLE / mixed-graph entries below them took 8.6-16 s each on 2 idle cores (2026-12-07), when
# the quick tiers had grown to 2 min 56 s against their 3-minute budget.
SLOW = (
    "tests/test_trained_models.py::",  # trains the built-in models once per session
    "tests/test_eagle.py::test_drafts_through_replayed_graphs_equal_the_reference",
    "tests/test_eagle.py::test_drafts_through_mixed_graphs_equal_the_reference",
    "tests/test_eagle.py::test_the_heads_graphs_are_captured_again_after_a_sleep",
    "tests/test_eagle.py::test_trained_head_is_recorded_and_agrees_with_its_target",
    "tests/test_kv_transfer.py::test_the_disaggregation_experiment_serves_the_same_tokens",
    "tests/test_mixed_graphs.py::test_mixed_graphs_with_engine_features[int8_kv]",
    "tests/test_mixed_graphs.py::test_mixed_graphs_with_engine_features[prefix_cache]",
    "tests/test_mixed_graphs.py::test_mixed_graphs_with_engine_features[prompt_logprobs]",
    "tests/test_mixed_graphs.py::test_mixed_steps_replayed_from_padded_buffers_give_the_same_tokens",
    "tests/test_mixed_graphs.py::test_speculative_steps_with_prompts_replay_mixed_graphs",
    "tests/test_models.py::test_gpt_families_generate_like_transformers[gpt-neox-sequential-triton]",
    "tests/test_moe.py::test_moe_bench_runs_and_agrees",
    "tests/test_quant_checkpoint.py::test_loaded_weights_equal_plain_dequantization[gptq]",
    "tests/test_sleep_mode.py::test_an_rl_loop_learns_and_the_engine_agrees_with_the_trainer",
    "tests/test_sliding_window.py::test_a_draft_model_keeps_every_block",
    "tests/test_sliding_window.py::test_engine_greedy_matches_transformers[triton]",
    "tests/test_sliding_window.py::test_engine_runs_past_the_window_under_preemption",
    "tests/test_sliding_window.py::test_parallel_samples_and_beams_share_blocks_past_the_window",
    "tests/test_spec.py::test_greedy_speculation_is_exact_under_any_logits_processors",
)


def is_listed_slow(nodeid: str) -> bool:
    """Whether a test's node id falls under an entry of ``SLOW``."""
    return nodeid.startswith(SLOW)


def tier_of_file(stem: str) -> str | None:
    """The tier a test file's tests default to, or None when the file is not listed."""
    for tier, stems in FILE_TIERS.items():
        if stem in stems:
            return tier
    return None
