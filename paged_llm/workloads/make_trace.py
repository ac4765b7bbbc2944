"""Derive a length-only trace (CSV ``input_len,output_len``) from a public dataset's JSON.

For someone with the dataset and a tokenizer; nothing here downloads unless asked::

    python -m paged_llm.workloads.make_trace sharegpt ShareGPT_V3_unfiltered_cleaned_split.json \\
        --tokenizer /path/to/opt-13b --out sharegpt_opt_lengths.csv
    python -m paged_llm.workloads.make_trace alpaca alpaca_data.json \\
        --tokenizer /path/to/opt-13b --out alpaca_opt_lengths.csv

``--tokenizer`` is a local Hugging Face tokenizer directory; a hub name (``facebook/opt-13b``)
works with ``--allow-download``. Every row of the dataset that has a prompt and a reply is
written, unfiltered (as the shipped ShareGPT trace is); the summary printed (and
:func:`length_summary`) applies the paper's filter, input + output < 2048. Counts are the
tokenizer's ``encode`` with its special tokens, as vLLM's benchmark scripts count them (OPT
adds ``</s>`` in front of each text). See ``data/README.md`` for what the shipped trace is.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from paged_llm.workloads.lengths import PAPER_MAX_TOTAL, LengthPair, filter_total_below
from paged_llm.workloads.traces import _encoder, load_sharegpt_json

Encode = Callable[[str], list[int]]


def alpaca_prompt(item: dict[str, Any]) -> str:
    """An Alpaca record's prompt: the instruction, then its optional input on a new line.

    The paper does not say how it joined them; this keeps both texts and adds no template, so
    the mean input length is a lower bound of any templated prompt's."""
    extra = item.get("input") or ""
    return item["instruction"] + ("\n" + extra if extra else "")


def load_alpaca_json(path: str | Path, tokenizer: Any) -> list[LengthPair]:
    """(prompt, output) token lengths of every record of ``alpaca_data.json``."""
    encode = _encoder(tokenizer)
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of Alpaca records")
    pairs = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or "instruction" not in item or "output" not in item:
            raise ValueError(f"{path}: record {i} lacks 'instruction' or 'output'")
        pairs.append(LengthPair(len(encode(alpaca_prompt(item))), len(encode(item["output"]))))
    return pairs


# One line per dataset: its JSON reader.
DATASETS: dict[str, Callable[[Path, Any], list[LengthPair]]] = {
    "sharegpt": load_sharegpt_json,
    "alpaca": load_alpaca_json,
}


def write_length_csv(pairs: Iterable[LengthPair], path: str | Path) -> Path:
    """Write pairs as CSV with an ``input_len,output_len`` header (what ``load_trace`` reads)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["input_len", "output_len"])
        writer.writerows((p.input_len, p.output_len) for p in pairs)
    return out


def percentile(sorted_values: list[int], q: float) -> int:
    """The nearest-rank q-th percentile (0 < q <= 100) of sorted values."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def length_summary(pairs: list[LengthPair], max_total_len: int = PAPER_MAX_TOTAL) -> dict[str, Any]:
    """Row counts, and means and percentiles after the paper's filter (input + output < max)."""
    kept = filter_total_below(pairs, max_total_len)
    if not kept:
        raise ValueError(f"no pair passes input + output < {max_total_len}")
    out: dict[str, Any] = {"rows": len(pairs), "rows_after_filter": len(kept)}
    for side in ("input_len", "output_len"):
        values = sorted(getattr(p, side) for p in kept)
        out[side] = {
            "mean": sum(values) / len(values),
            **{f"p{q}": percentile(values, q) for q in (10, 50, 90, 99)},
        }
    return out


def _load_tokenizer(name_or_path: str, allow_download: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, local_files_only=not allow_download)


def make_trace(
    dataset: str, json_path: str | Path, tokenizer: Any, out: str | Path
) -> dict[str, Any]:
    """Tokenize ``json_path`` as ``dataset``, write the CSV to ``out``; return its summary."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset '{dataset}'; choose one of {list(DATASETS)}")
    if not Path(json_path).is_file():
        raise FileNotFoundError(f"dataset JSON '{json_path}' not found")
    pairs = DATASETS[dataset](Path(json_path), tokenizer)
    if not pairs:
        raise ValueError(f"{json_path}: no record with a prompt and a reply")
    write_length_csv(pairs, out)
    return length_summary(pairs)


def main(argv: list[str] | None = None) -> None:
    """Command line: dataset name, JSON path, tokenizer, output CSV."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", choices=list(DATASETS))
    ap.add_argument("json", help="the dataset's JSON file")
    ap.add_argument("--tokenizer", required=True, help="a local HF tokenizer directory (or name)")
    ap.add_argument("--out", required=True, help="the CSV to write")
    ap.add_argument("--allow-download", action="store_true", help="let transformers fetch it")
    args = ap.parse_args(argv)
    tok = _load_tokenizer(args.tokenizer, args.allow_download)
    summary = make_trace(args.dataset, args.json, tok, args.out)
    print(json.dumps({"csv": str(args.out), **summary}, indent=2))


if __name__ == "__main__":
    main()
