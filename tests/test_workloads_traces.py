"""The shipped length trace (found from any directory, close to the paper's Fig. 11, the
figures' default) and the scripts that derive a trace from ShareGPT / Alpaca JSON, run on a
tiny JSON and a tokenizer built here."""

import csv
import json

import pytest

from paged_llm.models.tokenizer_builder import build_tokenizer
from paged_llm.workloads.lengths import LengthPair
from paged_llm.workloads.make_trace import (
    alpaca_prompt,
    length_summary,
    main,
    make_trace,
    percentile,
)
from paged_llm.workloads.traces import (
    DATA_DIR,
    SHAREGPT_TRACE,
    length_source,
    load_trace,
    resolve_trace_path,
)
from paper_repro.common import compose
from paper_repro.paper_numbers import FIG11_MEAN_LENGTHS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The project's own byte-level BPE (its encodings start with <s>, as OPT's do)."""
    from transformers import AutoTokenizer

    path = build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)
    return path, AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_shipped_trace_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = resolve_trace_path(SHAREGPT_TRACE)
    assert path.parent == DATA_DIR and path.is_file()
    assert load_trace(SHAREGPT_TRACE)[:2] == [LengthPair(21, 518), LengthPair(8, 66)]
    with pytest.raises(FileNotFoundError, match="shipped:sharegpt_opt_lengths.csv"):
        resolve_trace_path("shipped:missing.csv")
    with pytest.raises(FileNotFoundError, match="no shipped trace"):
        resolve_trace_path("shipped:../traces.py")


def test_shipped_trace_matches_the_papers_fig11():
    """Filtered as the paper does, the trace's means are within 0.1% of Fig. 11's."""
    summary = length_summary(load_trace(SHAREGPT_TRACE))
    assert summary["rows"] == 84226 and summary["rows_after_filter"] == 79725
    for side, paper in FIG11_MEAN_LENGTHS["sharegpt"].items():
        assert summary[side]["mean"] == pytest.approx(paper, rel=1e-3)
    # the percentiles the data README quotes
    assert [summary["input_len"][f"p{q}"] for q in (10, 50, 90, 99)] == [9, 35, 506, 1460]
    assert [summary["output_len"][f"p{q}"] for q in (10, 50, 90, 99)] == [45, 271, 754, 1280]


@pytest.mark.parametrize("name", ["fig2", "fig12", "fig13", "fig15", "fig17", "fig18b"])
def test_figures_default_to_the_shipped_trace(name, monkeypatch):
    monkeypatch.delenv("PAGED_LLM_SHAREGPT_TRACE", raising=False)
    cfg = compose(name)
    paths = [cfg.workload.path] + [w.path for w in (cfg.get("workloads") or {}).values()]
    assert SHAREGPT_TRACE in paths
    assert all(p in (SHAREGPT_TRACE, None) for p in paths)  # Alpaca: synthetic, no trace


def test_synthetic_lengths_stay_an_explicit_choice(monkeypatch):
    monkeypatch.delenv("PAGED_LLM_SHAREGPT_TRACE", raising=False)
    cfg = compose("fig2", ["workload.path=null"])
    src = length_source(cfg.workload.path, cfg.workload.synthetic, pool_size=100)
    assert src.synthetic and src.label.startswith("synthetic:sharegpt")
    monkeypatch.setenv("PAGED_LLM_SHAREGPT_TRACE", "/elsewhere/trace.csv")
    assert compose("fig2").workload.path == "/elsewhere/trace.csv"


def test_percentile_nearest_rank():
    assert [percentile([1, 2, 3, 4], q) for q in (10, 50, 90, 100)] == [1, 2, 4, 4]
    with pytest.raises(ValueError):
        percentile([], 50)


def read_csv(path):
    with open(path, newline="") as f:
        return [(int(r["input_len"]), int(r["output_len"])) for r in csv.DictReader(f)]


def test_sharegpt_json_to_trace(tmp_path, tokenizer):
    """First two turns per conversation, counted with the tokenizer's <s>; shorter ones
    skipped; the CSV reads back through load_trace."""
    tok_path, tok = tokenizer
    convs = [
        {"id": "a", "conversations": [
            {"from": "human", "value": "def f(x):"}, {"from": "gpt", "value": "return x"},
            {"from": "human", "value": "more"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "c", "conversations": [
            {"from": "human", "value": "import os"}, {"from": "gpt", "value": ""}]},
    ]  # fmt: skip
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(convs))
    out = tmp_path / "trace.csv"
    summary = make_trace("sharegpt", src, tok, out)
    want = [
        (len(tok.encode("def f(x):")), len(tok.encode("return x"))),
        (len(tok.encode("import os")), len(tok.encode(""))),
    ]
    assert want[1][1] == 1  # an empty reply is just <s>
    assert read_csv(out) == want == [tuple(p) for p in load_trace(out)]
    assert summary["rows"] == 2 and summary["rows_after_filter"] == 2
    assert summary["input_len"]["mean"] == pytest.approx((want[0][0] + want[1][0]) / 2)
    # the command line, with the tokenizer directory
    main(["sharegpt", str(src), "--tokenizer", str(tok_path), "--out", str(tmp_path / "c.csv")])
    assert read_csv(tmp_path / "c.csv") == want


def test_alpaca_json_to_trace(tmp_path, tokenizer):
    _, tok = tokenizer
    records = [
        {"instruction": "Sort the list.", "input": "3, 1, 2", "output": "1, 2, 3"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ]
    assert alpaca_prompt(records[0]) == "Sort the list.\n3, 1, 2"
    assert alpaca_prompt(records[1]) == "Say hi."
    src = tmp_path / "alpaca_data.json"
    src.write_text(json.dumps(records))
    out = tmp_path / "alpaca.csv"
    make_trace("alpaca", src, tok, out)
    want = [(len(tok.encode(alpaca_prompt(r))), len(tok.encode(r["output"]))) for r in records]
    assert read_csv(out) == want


def test_make_trace_refuses_bad_input(tmp_path, tokenizer):
    _, tok = tokenizer
    with pytest.raises(ValueError, match="unknown dataset"):
        make_trace("dolly", tmp_path / "x.json", tok, tmp_path / "o.csv")
    with pytest.raises(FileNotFoundError, match="not found"):
        make_trace("alpaca", tmp_path / "x.json", tok, tmp_path / "o.csv")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "no output"}]))
    with pytest.raises(ValueError, match="record 0"):
        make_trace("alpaca", bad, tok, tmp_path / "o.csv")
    bad.write_text(json.dumps([{"conversations": []}]))
    with pytest.raises(ValueError, match="no record"):
        make_trace("sharegpt", bad, tok, tmp_path / "o.csv")
    assert not (tmp_path / "o.csv").exists()
