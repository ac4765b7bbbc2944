"""GPU simulation: hardware and model-shape presets, a roofline step-time cost model, and an
executor that drives the real scheduler and KV managers on a virtual clock (no torch)."""
