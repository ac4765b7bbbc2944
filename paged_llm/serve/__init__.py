"""OpenAI-compatible HTTP server for the paged engine (``python -m paged_llm.serve``).

Modules: ``cli`` (vLLM's serve flags), ``app`` (FastAPI routes), ``async_engine`` (the engine
loop thread), ``protocol`` (request bodies), ``prompts`` (prompt rendering), ``render``
(response JSON), ``metrics`` (Prometheus text), ``errors`` and ``background`` (a server thread
for tests and notebooks); ``async_llm_engine`` is vLLM's ``AsyncLLMEngine`` on the same engine
loop, for your own asyncio server. See docs/serving.md.
"""
