"""``python -m paged_llm.serve`` / ``paged-llm-serve``: vLLM's ``serve`` flags, then uvicorn.

A vLLM command line works with the program name changed. Flags for features the engine does
not have (pipeline parallelism) are refused at startup when set to anything but their
default, instead of being silently ignored. Values the engine would reject anyway (an unknown
quantization method, KV cache dtype or speculative method) are refused before the model loads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from paged_llm.engine.reasoning import REASONING_PARSERS
from paged_llm.serve.async_engine import DEFAULT_STALL_TIMEOUT_S
from paged_llm.serve.limits import RequestLimits
from paged_llm.serve.tool_calls import TOOL_PARSERS, tool_parser

logger = logging.getLogger("paged_llm.serve")

DEFAULT_MODEL = "tiny"


def make_parser() -> argparse.ArgumentParser:
    """The argument parser (vLLM's names and defaults where they exist)."""
    p = argparse.ArgumentParser(
        prog="paged-llm-serve",
        description="OpenAI-compatible server for paged-llm (vLLM's serve flags).",
    )
    p.add_argument("model_tag", nargs="?", help="model directory or preset (same as --model)")
    p.add_argument("--model", help=f"model directory or built-in preset (default {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients use (default: --model)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")

    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (vLLM: all)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes",
    )
    srv.add_argument("--chat-template", help="chat template file (or inline Jinja text)")
    srv.add_argument("--max-logprobs", type=int, default=20)
    srv.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="/v1/responses kept in memory for previous_response_id and GET (oldest dropped; "
        "0 stores none)",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs a parser',
    )
    srv.add_argument(
        "--tool-call-parser",
        help="the model's tool-call format: " + ", ".join(sorted(TOOL_PARSERS)),
    )
    srv.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests allowed to wait for their first token; more get 429 (0: no limit)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    lim = p.add_argument_group('request limits (docs/serving.md, "Limits")')
    lim.add_argument("--max-request-body-bytes", type=int, default=RequestLimits.max_body_bytes,
                     help="larger request bodies get 413, refused while reading")  # fmt: skip
    lim.add_argument("--max-json-depth", type=int, default=RequestLimits.max_json_depth,
                     help="bodies nested deeper get 400")  # fmt: skip
    lim.add_argument("--max-stop-strings", type=int, default=RequestLimits.max_stop_strings,
                     help="entries of stop (and of bad_words) a request may give")  # fmt: skip
    lim.add_argument("--max-stop-string-chars", type=int,
                     default=RequestLimits.max_stop_string_chars,
                     help="the longest stop string (or bad word) a request may give")  # fmt: skip
    lim.add_argument("--max-logit-bias", type=int, default=RequestLimits.max_logit_bias,
                     help="logit_bias entries a request may give")  # fmt: skip
    lim.add_argument("--engine-stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                     help="/health answers 503 while one engine step runs longer than this many "
                     "seconds (0: never)")  # fmt: skip
    lim.add_argument("--tokenizer-threads", type=int, default=4,
                     help="threads that tokenize prompts (each with its own tokenizer copy), "
                     "off the engine loop")  # fmt: skip
    srv.add_argument("--timeout-keep-alive", type=int, default=5)
    srv.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical", "trace"],
    )
    srv.add_argument("--disable-uvicorn-access-log", action="store_true")
    srv.add_argument("--enable-log-requests", action="store_true")
    srv.add_argument("--disable-log-requests", action="store_true", help="(default; accepted)")
    srv.add_argument("--disable-log-stats", action="store_true")

    eng = p.add_argument_group("engine")
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--device", default="auto")
    eng.add_argument("--max-model-len", type=int)
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument(
        "--cpu-kv-cache-gib",
        type=float,
        default=_env_float("VLLM_CPU_KVCACHE_SPACE"),
        help="KV pool size on CPU (default: $VLLM_CPU_KVCACHE_SPACE or 1 GiB)",
    )
    eng.add_argument("--swap-space", type=float, default=4.0)
    eng.add_argument("--num-gpu-blocks-override", type=int)
    eng.add_argument("--kv-cache-dtype", default="auto", help="auto, int8, fp8_e4m3 (or fp8)")
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int)
    eng.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    eng.add_argument("--preemption-mode", choices=["recompute", "swap"])
    eng.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="fcfs (default) or priority: requests' priority field, smaller first",
    )
    eng.add_argument(
        "--async-scheduling",
        action="store_true",
        help="plan and launch step N + 1 while the GPU runs step N (same tokens)",
    )
    eng.add_argument("--policy", help="KV allocation policy (paged, orca_max, ..., static)")
    eng.add_argument("--attention-backend", help="auto, torch, cpu, triton or contiguous")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    eng.add_argument(
        "--kv-offloading-size",
        type=float,
        help="GiB of CPU memory for a second prefix-cache tier (needs --enable-prefix-caching)",
    )
    eng.add_argument(
        "--speculative-config",
        type=_json_object,
        help='JSON, as in vLLM: {"method": "ngram", "num_speculative_tokens": 3}',
    )
    eng.add_argument(
        "--kv-transfer-config",
        type=_json_object,
        help='JSON, as in vLLM: {"kv_connector": "SharedStorageConnector", "kv_role": '
        '"kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/path"}}',
    )
    eng.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling settings: auto (the model's generation_config.json), vllm "
        "(paged-llm's own) or a directory holding a generation_config.json",
    )
    eng.add_argument(
        "--override-generation-config",
        type=_json_object,
        help='JSON laid over the generation config, e.g. {"temperature": 0.5}',
    )
    eng.add_argument(
        "--runner",
        choices=["generate", "pooling"],
        help="generate (completions, chat) or pooling (/v1/embeddings); docs/pooling.md",
    )
    eng.add_argument("--task", help="vLLM's older flag: embed means --runner pooling")
    eng.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="the model thinks in <think> ... </think>: replies carry it as 'reasoning', and "
        "structured outputs constrain only the answer",
    )
    eng.add_argument(
        "--pooler-config",
        type=_json_object,
        help='JSON, e.g. {"pooling_type": "MEAN", "normalize": true} (default: the checkpoint\'s '
        "sentence-transformers files, else LAST, normalised)",
    )
    lora = p.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help='adapters clients select by "model": name=path, or JSON {"name": ..., "path": ...,'
        ' "base_model_name": ...}',
    )
    lora.add_argument("--max-loras", type=int, help="adapters in one batch (default 1)")
    lora.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, help="adapters kept in CPU memory")
    eng.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    eng.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with -tp N, each rank holds 1/N of a mixture-of-experts model's experts whole",
    )
    eng.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    eng.add_argument(
        "-q", "--quantization", help="int8, int4_rtn, int4_gptq, int4_awq, fp8, gptq, awq"
    )
    eng.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for compatibility; no remote code is ever run",
    )
    eng.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="allow sleep / wake_up (the endpoints need VLLM_SERVER_DEV_MODE=1)",
    )
    eng.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs for decode steps (they are only used on CUDA)",
    )
    return p


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def _json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object (argparse turns the error into exit status 2)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def model_name(args: argparse.Namespace) -> str:
    """The model to load: the positional argument or --model (they must agree)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"model given twice: '{args.model_tag}' and --model '{args.model}'")
    return args.model_tag or args.model or DEFAULT_MODEL


def check_quantization(name: str | None) -> None:
    """Refuse an unknown --quantization name before the model loads."""
    from paged_llm.quant.registry import method_names

    if name is not None and name not in method_names():
        raise ValueError(f"--quantization: unknown method '{name}'; choose one of {method_names()}")


def check_kv_cache_dtype(name: str) -> None:
    """Refuse an unknown --kv-cache-dtype before the model loads."""
    from paged_llm.quant.kv_cache import KV_CACHE_DTYPES

    choices = ["auto", *KV_CACHE_DTYPES]
    if name not in choices:
        raise ValueError(f"--kv-cache-dtype: unknown dtype '{name}'; choose one of {choices}")


def check_speculative_config(spec: dict[str, Any] | None) -> None:
    """Build (not load) the drafter, so a bad --speculative-config fails before the model."""
    from paged_llm.spec.registry import build_drafter

    try:
        build_drafter(spec)
    except ValueError as err:  # unknown method, missing k, a key the method does not take
        raise ValueError(f"--speculative-config: {err}") from None


def check_kv_transfer_config(config: dict[str, Any] | None) -> None:
    """Refuse a bad --kv-transfer-config (role, keys, connector name) before the model."""
    from paged_llm.kv_transfer import KV_CONNECTORS, as_kv_transfer_config
    from paged_llm.utils.registry import resolve

    try:
        parsed = as_kv_transfer_config(config)
        if parsed is not None:
            resolve("KV connector", parsed.kv_connector, KV_CONNECTORS)
    except ValueError as err:
        raise ValueError(f"--kv-transfer-config: {err}") from None


def check_generation_overrides(overrides: dict[str, Any] | None) -> None:
    """Refuse an --override-generation-config that makes invalid SamplingParams."""
    from paged_llm.engine.generation_config import load_generation_defaults

    try:
        load_generation_defaults(None, None, "vllm", overrides)
    except ValueError as err:
        raise ValueError(f"--override-generation-config: {err}") from None


def lora_modules(args: argparse.Namespace) -> dict[str, Any]:
    """--lora-modules as {served name: LoRARequest}, ids 1, 2, ... in the order given."""
    from paged_llm.lora.request import LoRARequest

    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    served = set(args.served_model_name or [model_name(args)])
    out: dict[str, LoRARequest] = {}
    for i, item in enumerate(args.lora_modules or [], start=1):
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"--lora-modules: bad JSON entry {item!r} ({err})") from None
            base = spec.get("base_model_name")
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected NAME=PATH, got {item!r}")
            base = None
        if name in out or name in served:
            raise ValueError(f"--lora-modules: the name '{name}' is used twice")
        out[name] = LoRARequest(name, i, path, base_model_name=base)
    return out


def runtime_lora_updating() -> bool:
    """vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default:
    they read any path the server can)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def server_dev_mode() -> bool:
    """vLLM's switch for the development endpoints (sleep mode, collective_rpc)."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments; ValueError for flags the engine cannot honour."""
    refused = {"--pipeline-parallel-size": args.pipeline_parallel_size != 1}
    for flag, bad in refused.items():
        if bad:
            raise ValueError(f"{flag} is not supported by paged-llm (tensor parallelism only)")
    check_quantization(args.quantization)
    check_kv_cache_dtype(args.kv_cache_dtype)
    check_speculative_config(args.speculative_config)
    check_kv_transfer_config(args.kv_transfer_config)
    check_generation_overrides(args.override_generation_config)
    lora_modules(args)
    kwargs: dict[str, Any] = {
        "model": model_name(args),
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "seed": args.seed,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "cpu_kv_cache_gib": args.cpu_kv_cache_gib,
        "swap_space": args.swap_space,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "preemption_mode": args.preemption_mode,
        "async_scheduling": args.async_scheduling or None,
        "scheduling_policy": args.scheduling_policy,
        "policy": args.policy,
        "attention_backend": args.attention_backend,
        "log_stats": not args.disable_log_stats,
        "enable_prefix_caching": args.enable_prefix_caching or None,
        "kv_offloading_size": args.kv_offloading_size,
        "speculative_config": args.speculative_config or None,
        "kv_transfer_config": args.kv_transfer_config or None,
        "quantization": args.quantization,
        "kv_cache_dtype": None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "enforce_eager": args.enforce_eager,
        "enable_sleep_mode": args.enable_sleep_mode,
        "generation_config": args.generation_config,
        "override_generation_config": args.override_generation_config,
        "enable_lora": args.enable_lora or None,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
        "runner": args.runner,
        "task": args.task,
        "pooler_config": args.pooler_config,
        "reasoning_parser": args.reasoning_parser,
    }
    return {k: v for k, v in kwargs.items() if v is not None}  # None: the engine's default


def load_chat_template(value: str | None) -> str | None:
    """A template file's contents, or the argument itself if it is inline Jinja."""
    if value is None:
        return None
    path = Path(value).expanduser()
    with contextlib.suppress(OSError):  # a long inline template is too long for a file name
        if path.is_file():
            return path.read_text(encoding="utf-8")
    if "{" in value:
        return value
    raise ValueError(f"--chat-template: no such file '{value}'")


def server_settings(args: argparse.Namespace) -> Any:
    """The app's settings from the server flags (raises ValueError on bad ones)."""
    from paged_llm.serve.app import ServerSettings

    if args.max_waiting < 0:
        raise ValueError("--max-waiting must be >= 0 (0: no limit)")
    if args.max_logprobs < 0:
        raise ValueError("--max-logprobs must be >= 0")
    if args.max_stored_responses < 0:
        raise ValueError("--max-stored-responses must be >= 0")
    if args.tokenizer_threads < 1:
        raise ValueError("--tokenizer-threads must be >= 1")
    if args.engine_stall_timeout < 0:
        raise ValueError("--engine-stall-timeout must be >= 0 (0: never)")
    model = model_name(args)
    parser = tool_parser(args.tool_call_parser) if args.tool_call_parser else None
    if args.enable_auto_tool_choice and parser is None:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({known})")
    return ServerSettings(
        served_model_names=args.served_model_name or [model],
        model_root=model,
        api_key=args.api_key,
        chat_template=load_chat_template(args.chat_template),
        max_logprobs=args.max_logprobs,
        log_requests=args.enable_log_requests and not args.disable_log_requests,
        lora_modules=lora_modules(args),
        allow_runtime_lora_updating=runtime_lora_updating(),
        tool_parser=parser if args.enable_auto_tool_choice else None,
        max_stored_responses=args.max_stored_responses,
        dev_mode=server_dev_mode(),
        limits=request_limits(args),
    )


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The request limits from their flags (ValueError naming a bad one)."""
    flags = {"max_body_bytes": "--max-request-body-bytes", "max_json_depth": "--max-json-depth",
             "max_stop_strings": "--max-stop-strings",
             "max_stop_string_chars": "--max-stop-string-chars",
             "max_logit_bias": "--max-logit-bias"}  # fmt: skip
    values = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in flags.items()}
    for field, value in values.items():
        if value < 1:
            raise ValueError(f"{flags[field]} must be >= 1, got {value}")
    return RequestLimits(**values)


def build(args: argparse.Namespace) -> Any:
    """Load the engine and return the app (raises ValueError/OSError on bad settings)."""
    from paged_llm.config import EngineConfig
    from paged_llm.engine.llm_engine import LLMEngine
    from paged_llm.serve.app import build_app
    from paged_llm.serve.async_engine import AsyncEngine
    from paged_llm.serve.metrics import ServerMetrics

    kwargs = engine_kwargs(args)
    settings = server_settings(args)
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    for lora in settings.lora_modules.values():  # a bad adapter stops the server here
        engine.add_lora(lora)
    metrics = ServerMetrics(settings.served_model_names[0])
    async_engine = AsyncEngine(engine, metrics, max_waiting=args.max_waiting or None,
                               stall_timeout=args.engine_stall_timeout or None,
                               tokenizer_threads=args.tokenizer_threads)  # fmt: skip
    return build_app(async_engine, settings)


def _exit_cleanly(signum: int, frame: Any) -> None:
    # uvicorn handles SIGTERM itself while serving (graceful shutdown) and re-raises it when
    # done; this handler makes that, or a SIGTERM during model loading, an exit with status 0
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load the engine, serve until SIGTERM / Ctrl-C."""
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        engine_kwargs(args)  # flag errors first, before the slow model load
        server_settings(args)
        app = build(args)
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except KeyboardInterrupt:
        return
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    logger.info("serving %s on http://%s:%d", model_name(args), args.host, args.port)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn already shut down
        uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
