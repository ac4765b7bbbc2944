"""CUDA graphs on the CPU: ``EagerReplay`` runs exactly what a captured graph replays (the static
buffers of the batch's bucket and stride, padding included) but eagerly, so the Triton
interpreter can check the padding and the replay plumbing (shared by test_gpu_check.py and
test_eagle.py)."""

from paged_llm.runner import controls
from paged_llm.runner.cuda_graphs import CudaGraphRunner


class EagerReplay(CudaGraphRunner):
    """A CudaGraphRunner whose "graphs" are eager runs over the static buffers."""

    def capture(self) -> None:
        self.replays: list[tuple[int, int]] = []
        self.graphs = dict.fromkeys(self.keys)  # key_for only asks which keys exist

    def launch(self, key):
        self.replays.append(key)
        return self.run_static(key)


def replay_graphs_eagerly(llm, monkeypatch, sizes, strides=(1,), mixed_tokens=()):
    """Capture the engine's graphs (the target's and its drafter's, as the runner does on
    CUDA) as ``EagerReplay`` runners; return the target's."""
    monkeypatch.setattr(controls, "CudaGraphRunner", EagerReplay)
    engine = llm.llm_engine
    engine.runner.capture_cuda_graphs(sizes, engine.max_model_len, strides, mixed_tokens)
    return engine.runner.cuda_graphs
