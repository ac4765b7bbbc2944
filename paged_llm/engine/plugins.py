"""Where plug-ins written before 2026-12-07 import the plug-in interface from: ``EnginePlugin``
and ``StepState`` now live beside the step loop that calls them (engine/core.py), and this
module keeps the old import path working (issue 50: nothing that worked stops working)."""

from paged_llm.engine.core import EnginePlugin, StepState

__all__ = ["EnginePlugin", "StepState"]
