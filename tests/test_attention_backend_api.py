"""The attention backend interface: CUDA-graph safety and the metadata builder are declared by
each backend, so swapping one in needs no name lists elsewhere."""

from __future__ import annotations

import dataclasses

import torch

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata, build_attention_metadata
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.attention.triton_backend import TritonAttentionBackend
from paged_llm.runner.cuda_graphs import capture_sizes, cuda_graph_sizes
from paged_llm.spec.any_order import build_metadata_any_order


class RecordingBackend(AttentionBackend):
    """A toy backend: records every metadata build, then delegates to the default layout."""

    name = "recording"

    def __init__(self, graph_safe: bool = False) -> None:
        self.cuda_graph_safe = graph_safe
        self.calls: list[tuple] = []

    def build_metadata(self, query_lens, seq_lens, block_tables, block_size, device="cpu"):
        """Record the call and build the default metadata."""
        self.calls.append((list(query_lens), list(seq_lens), block_tables, block_size, device))
        return super().build_metadata(query_lens, seq_lens, block_tables, block_size, device)

    def forward(self, query, key, value, k_cache, v_cache, meta, scale, **kw):
        """Not used here."""
        raise NotImplementedError


def assert_same_metadata(a: AttentionMetadata, b: AttentionMetadata) -> None:
    """Every field equal: tensors by value, dtype and device, the rest by ==."""
    for f in dataclasses.fields(AttentionMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), f.name
            assert x.dtype == y.dtype and x.device == y.device, f.name
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def test_graph_safety_is_declared_by_the_backend():
    # cuda_graph_sizes only reads device.type, so a CUDA device works without a GPU
    cuda = torch.device("cuda")
    assert cuda_graph_sizes(cuda, False, RecordingBackend(graph_safe=False), 1, 8) == []
    assert cuda_graph_sizes(cuda, False, RecordingBackend(graph_safe=True), 1, 8) == [1, 2, 4, 8]
    assert cuda_graph_sizes(cuda, False, RecordingBackend(True), 1, 300) == capture_sizes(300)
    assert cuda_graph_sizes(torch.device("cpu"), False, RecordingBackend(True), 1, 8) == []
    assert TritonAttentionBackend.cuda_graph_safe and not TorchAttentionBackend.cuda_graph_safe
    assert not AttentionBackend.cuda_graph_safe  # safe only when a backend says so


def test_default_build_metadata_matches_the_function():
    args = ([1, 1, 3, 5], [7, 2, 3, 9], [[4, 0], [1], [2], [3, 5, 6]], 4)
    got = TorchAttentionBackend().build_metadata(*args)
    assert_same_metadata(got, build_attention_metadata(*args))
    got = TorchAttentionBackend().build_metadata(*args, device="cpu")
    assert_same_metadata(got, build_attention_metadata(*args, "cpu"))


def test_override_is_called_and_reaches_any_order_builds():
    backend = RecordingBackend()
    meta = backend.build_metadata([1, 3], [5, 3], [[1, 2], [0]], 4)
    assert backend.calls == [([1, 3], [5, 3], [[1, 2], [0]], 4, "cpu")]
    assert_same_metadata(meta, build_attention_metadata([1, 3], [5, 3], [[1, 2], [0]], 4))
    # drafters order their own batches; the backend's builder still makes the metadata
    args = ([3, 1], [3, 5], [[0], [1, 2]], 4)
    meta, rows, back = build_metadata_any_order(*args, build=backend.build_metadata)
    assert len(backend.calls) == 2 and backend.calls[-1][:2] == ([1, 3], [5, 3])
    assert_same_metadata(meta, build_metadata_any_order(*args)[0])
    assert rows.tolist() == [3, 0, 1, 2] and back.tolist() == [1, 2, 3, 0]
