"""The engine: scheduler + model runner + detokenization behind vLLM's LLMEngine API."""
