"""Registers paged-llm's typed config schemas and the ``--help`` resolver for every Hydra entry
point: Hydra imports each module under ``hydra_plugins`` before it composes a config, so
``import paged_llm`` itself need not import hydra (the server and ``LLM`` start faster)."""

from paged_llm import config_help, config_schemas

# Hydra's plugin scan may execute this module more than once; both calls are idempotent.
config_schemas.register()
config_help.register()
