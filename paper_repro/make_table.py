"""Regenerate the results table of paper_repro/README.md from figure result files.

``python -m paper_repro.make_table [RESULT_DIR ...]``: each directory holds a figN.json (a
figure run's Hydra directory); without arguments the newest run of every figure under
``outputs/paper_repro/`` (and ``multirun/paper_repro/`` for sweeps) is used. The table goes
between the ``results:start`` / ``results:end`` markers of the README, replacing the blocks of
the figures (and modes) found and keeping the others as they are (each names its date and
command). With several seeds a cell is the mean and its Student-t 95% interval over the seeds,
"mean [low, high]", and the check compares the mean."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from paper_repro.paper_numbers import (
    FIG1_THROUGHPUT,
    FIG2,
    FIG13,
    FIG14_GAIN_OVER_ORACLE,
    FIG16_GAIN_OVER_ORACLE,
    FIG17_GAIN_OVER_ORCA,
    FIG18B,
    FIG19_RECOMPUTE_MS,
    FIG19_SWAP_MS,
)
from paper_repro.seeds import stat, value_at
from paper_repro.verdicts import FAIL, LOWER_BOUND, PASS, UNDETERMINED, UPPER_BOUND, verdict_of

ROOT = Path(__file__).resolve().parents[1]
README = Path(__file__).resolve().parent / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
Row = tuple[str, str, str, str]  # quantity, ours, paper, check


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _ci(d: dict[str, Any], path: str, show: Callable[[Any], str] = _num) -> str:
    """'mean [low, high]' of the quantity at ``path`` over the seeds; the plain value for one
    seed or a result file from before seeds."""
    s = stat(d, path)
    if s is None or s["ci95_low"] is None:
        return show(value_at(d, path))
    return f"{show(s['mean'])} [{show(s['ci95_low'])}, {show(s['ci95_high'])}]"


def _times(x: float | None) -> str:
    """A ratio ('3.32x'); '- (unbounded)' where a seed's denominator sustained no rate."""
    return "- (unbounded)" if x is None else f"{x:.2f}x"


def _check(acc: dict[str, Any], key: str) -> str:
    a = acc.get(key)
    if a is None:
        return "-"
    v = verdict_of(a)
    return "**fail**" if v == FAIL else v


# How a sustained rate that is a bound of the rate grid is written beside its number.
_BOUND_MARK = {LOWER_BOUND: ">= ", UPPER_BOUND: "<= "}


def fig2_rows(d: dict[str, Any]) -> list[Row]:
    """Token-state shares per policy."""
    acc = d.get("acceptance", {})
    rows = []
    for p in ("orca_max", "orca_pow2", "orca_oracle", "paged"):
        if p in d:
            rows.append(
                (
                    f"Fig. 2 token states, {p}",
                    _ci(d, f"{p}/token_states", _pct),
                    _pct(FIG2[p]["token_states"]),
                    _check(acc, f"{p}_token_states"),
                )
            )
    return rows


def fig12_rows(d: dict[str, Any]) -> list[Row]:
    """Sustained rates and the paged policy's ratios over the others."""
    acc = d.get("acceptance", {})
    rows = []
    for p in ("paged", "orca_oracle", "orca_pow2", "orca_max", "static"):
        if p in d:
            rate, cap = _ci(d, f"{p}/max_sustained_rate"), _ci(d, f"{p}/saturation_throughput")
            kind = d[p].get("sustained_rate_kind")
            mark = _BOUND_MARK.get(kind, "")
            note = " (top of grid)" if kind == LOWER_BOUND else ""
            ours = f"{mark}{rate}{note} (capacity {cap})"
            rows.append((f"Fig. 12 max sustained rate, {p} (req/s)", ours, "-", "-"))
    paper = {"orca_oracle": "1.7-2.7x", "orca_max": "2.7-8x", "static": "up to 22x"}
    for p in d.get("ratios_vs_paged", {}):
        rows.append(
            (
                f"Fig. 12 paged / {p}",
                _ci(d, f"ratios_vs_paged/{p}", _times),
                paper.get(p, "-"),
                _check(acc, f"paged_over_{p}"),
            )
        )
    cap = d.get("ordering_by_saturation_throughput")
    if cap is not None:
        rows.append(
            ("Fig. 12 ordering by wall-clock capacity (informative)", str(cap), "True", "-")
        )
    order = d.get("ordering_paged_oracle_pow2_max")
    if order is not None:
        how = d.get("sustained_rate_from", "latency_threshold")
        rows.append(
            (
                f"Fig. 12 ordering paged > oracle > pow2 > max ({how})",
                str(order),
                "True",
                _check(acc, "ordering"),
            )
        )
    return rows


def fig13_rows(d: dict[str, Any]) -> list[Row]:
    """Mean batched requests per workload and policy."""
    acc = d.get("acceptance", {})
    rows = []
    for w in ("sharegpt", "alpaca"):
        for p in ("orca_max", "orca_pow2", "orca_oracle", "paged"):
            if p in d.get(w, {}):
                rate = d[w].get("request_rate")
                rows.append(
                    (
                        f"Fig. 13 batched requests, {w} @ {rate:g} req/s, {p}",
                        _ci(d, f"{w}/{p}/mean_batched_requests"),
                        _num(FIG13[w][p]),
                        _check(acc, f"{w}_{p}"),
                    )
                )
    return rows


def fig1_rows(d: dict[str, Any]) -> list[Row]:
    """Batch that fits the GPU and throughput at batch 40."""
    rows = []
    paper_fit = {"orca_max": "8", "paged": "~38"}
    for p in d.get("max_batch_in_memory", {}):
        rows.append(
            (
                f"Fig. 1 requests fitting the GPU, {p}",
                _ci(d, f"max_batch_in_memory/{p}", lambda x: _num(x, ".1f")),
                paper_fit.get(p, "-"),
                "-",
            )
        )
    index = {q["batch_size"]: i for i, q in enumerate(d.get("paged", []))}
    for b in (8, 40):
        if b in index:
            rows.append(
                (
                    f"Fig. 1 throughput at batch {b} (tokens/s; calibrated on it)",
                    _ci(d, f"paged/{index[b]}/throughput_tokens_per_s", lambda x: _num(x, ".0f")),
                    _num(FIG1_THROUGHPUT[b], ".0f"),
                    "-",
                )
            )
    return rows


def fig18b_rows(d: dict[str, Any]) -> list[Row]:
    """Normalized latency at each block size."""
    rows = []
    for w in ("sharegpt", "alpaca"):
        for p in d.get(w, []):
            b = p["block_size"]
            rows.append(
                (
                    f"Fig. 18b {w} @ {p['request_rate']:g} req/s, block {b} (s/token)",
                    _point_ci(p, "normalized_latency", ".3f"),
                    _num(FIG18B[w].get(b), ".3f"),
                    "-",
                )
            )
    return rows


def _point_ci(p: dict[str, Any], key: str, fmt: str) -> str:
    """'mean [low, high]' from a point's own ``ci95`` (Fig. 18b's merged sweep points)."""
    lo, hi = (p.get("ci95") or {}).get(key) or (None, None)
    ours = _num(p[key], fmt)
    return ours if lo is None else f"{ours} [{_num(lo, fmt)}, {_num(hi, fmt)}]"


def fig19_rows(d: dict[str, Any]) -> list[Row]:
    """Swap vs recompute cost at a few block sizes."""
    rows = []
    for mode in ("real", "simulated"):
        pts = d.get(mode, [])
        sizes = {pts[0]["block_size"], pts[-1]["block_size"], 16} if pts else set()
        for p in pts:
            b = p["block_size"]
            if b not in sizes:
                continue
            paper_swap = _num(FIG19_SWAP_MS.get(b), ".0f") if mode == "simulated" else "-"
            paper_rec = "{}-{}".format(*FIG19_RECOMPUTE_MS) if mode == "simulated" else "-"
            rows.append(
                (
                    f"Fig. 19 {mode} swap in+out, block {b} (ms)",
                    _num(p["swap_in_out_ms"]),
                    paper_swap,
                    "-",
                )
            )
            rows.append(
                (
                    f"Fig. 19 {mode} recompute, block {b} (ms)",
                    _num(p["recompute_ms"]),
                    paper_rec,
                    "-",
                )
            )
    return rows


_SWEEP_ORDER = ("paged", "orca_oracle", "orca_pow2", "orca_max")


def _sweep_rows(
    d: dict[str, Any], fig: str, paper_gain: Callable[[str, str], str], check: Callable[..., str]
) -> list[Row]:
    """Fig. 14/16/17: sustained rates per setting (a '+' marks a policy that never crossed the
    latency threshold: a lower bound) and the paged policy's gain over each Orca variant."""
    rows = []
    for s, res in d.items():
        if not isinstance(res, dict) or "ratios_vs_paged" not in res:
            continue
        pols = [p for p in _SWEEP_ORDER if p in res]
        ours = " / ".join(
            _ci(d, f"{s}/{p}/max_sustained_rate") + ("+" if _capped(res[p]) else "") for p in pols
        )
        rows.append(
            (
                f"{fig} {s}: sustained req/s, {' / '.join(pols)}",
                ours,
                "-",
                check(s),
            )
        )
        for p in res["ratios_vs_paged"]:
            # a policy that never crossed the threshold has a lower bound for a sustained rate
            bound = {(True, False): ">= ", (False, True): "<= "}.get(
                (_capped(res["paged"]), _capped(res[p])), ""
            )
            ours = bound + _ci(d, f"{s}/ratios_vs_paged/{p}", _times)
            if _capped(res["paged"]) and _capped(res[p]):
                ours += " (neither saturated)"
            rows.append((f"{fig} {s}: paged / {p}", ours, paper_gain(s, p), check(s, p)))
    return rows


def _capped(r: dict[str, Any]) -> bool:
    """True when the policy's curve never crossed the threshold (older files: rate == top)."""
    if "sustained_rate_kind" in r:
        return r["sustained_rate_kind"] == LOWER_BOUND
    return abs(r["max_sustained_rate"] - max(q["request_rate"] for q in r["points"])) < 1e-9


def fig14_rows(d: dict[str, Any]) -> list[Row]:
    """Parallel sampling and beam search: sustained rates and gains."""
    acc = d.get("acceptance", {})

    def gain(s: str, p: str) -> str:
        g = FIG14_GAIN_OVER_ORACLE.get(s) if p == "orca_oracle" else None
        return f"{g:g}x" if g else "-"

    return _sweep_rows(d, "Fig. 14", gain, lambda s, p=None: "-" if p else _ordered(acc, s))


def _ordered(acc: dict[str, Any], setting: str) -> str:
    c = _check(acc, f"{setting}_ordering")
    return f"{c} (ordering)" if c == "pass" else c


def fig15_rows(d: dict[str, Any]) -> list[Row]:
    """Memory saved by sharing per workload and setting."""
    acc = d.get("acceptance", {})
    rows = []
    for w in ("alpaca", "sharegpt"):
        for s, r in d.get(w, {}).items():
            if not isinstance(r, dict):
                continue
            ref = r.get("paper")
            paper = (
                _pct(ref) if isinstance(ref, float)
                else f"{_pct(ref[0])}-{_pct(ref[1])} (n/width 2-6)" if ref else "-"
            )  # fmt: skip
            b = r.get("bounds")
            ours = _ci(d, f"{w}/{s}/saving", _pct)
            if b:
                ours += f" (bounds {_pct(b['own'])}-{_pct(b['best'])})"
            rows.append(
                (
                    f"Fig. 15 memory saved, {w} @ {d[w]['request_rate']:g} req/s, {s}",
                    ours,
                    paper,
                    _check(acc, f"{w}_{s}"),
                )
            )
    if "alpaca_ordering" in acc:
        rows.append(
            ("Fig. 15 alpaca ordering", "see above", "as the paper", _check(acc, "alpaca_ordering"))
        )
    return rows


def fig16_rows(d: dict[str, Any]) -> list[Row]:
    """Shared prefix: sustained rates and paged / Orca (Oracle)."""
    acc = d.get("acceptance", {})

    def gain(s: str, p: str) -> str:
        g = FIG16_GAIN_OVER_ORACLE.get(s) if p == "orca_oracle" else None
        return f"{g:g}x" if g else "-"

    rows = _sweep_rows(d, "Fig. 16", gain, lambda key, p=None: "-" if p else _highest(acc, key))
    if "gain_grows_with_prefix" in acc:
        grows = str(acc["gain_grows_with_prefix"]["value"])
        rows.append(
            (
                "Fig. 16 gain grows with the prefix",
                grows,
                "True",
                _check(acc, "gain_grows_with_prefix"),
            )
        )
    return rows


def _highest(acc: dict[str, Any], setting: str) -> str:
    """'pass' when the paged policy sustains the highest rate of the setting (Fig. 16/17)."""
    mine = [a for k, a in acc.items() if k.startswith(f"{setting}_paged_over_")]
    if not mine:
        return "-"
    verdicts = {verdict_of(a) for a in mine}
    if FAIL in verdicts:
        return "**fail**"
    return UNDETERMINED if UNDETERMINED in verdicts else f"{PASS} (paged highest)"


def fig17_rows(d: dict[str, Any]) -> list[Row]:
    """Chatbot: sustained rates and paged / each Orca variant."""
    acc = d.get("acceptance", {})
    rows = _sweep_rows(
        d,
        "Fig. 17",
        lambda s, p: f"{FIG17_GAIN_OVER_ORCA:g}x",
        lambda key, p=None: "-" if p else _highest(acc, key),
    )
    pr = d.get("prompts")
    if pr:
        rows.append(
            (
                "Fig. 17 prompts cut to 1024 tokens",
                _pct(pr["share_at_prompt_cap"]),
                "most",
                "-",
            )
        )
    return rows


FIGURES: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "fig1": fig1_rows,
    "fig2": fig2_rows,
    "fig12": fig12_rows,
    "fig13": fig13_rows,
    "fig14": fig14_rows,
    "fig15": fig15_rows,
    "fig16": fig16_rows,
    "fig17": fig17_rows,
    "fig18b": fig18b_rows,
    "fig19": fig19_rows,
}


def source(d: dict[str, Any]) -> str:
    """Where a result came from: real/simulated, hardware, lengths, date, command."""
    info = d.get("run_info", {})
    hw = info.get("hardware")
    hw = "; ".join(hw.values()) if isinstance(hw, dict) else hw
    kinds = [
        f"{w['name']} {'synthetic' if w['synthetic'] else 'trace'}"
        for w in info.get("workloads", [])
    ]
    lengths = "lengths: " + ", ".join(dict.fromkeys(kinds)) if kinds else ""
    date = str(info.get("date", ""))[:10]
    cmd = info.get("command")
    wall = info.get("wall_time_s")  # stamped by paper_repro.all_figures
    where = info.get("computed_on") or "this machine"
    load = info.get("load_average_1m")
    busy = f" (load {load:g} on {info.get('cpus')} cores)" if load is not None else ""
    took = f"; {wall:.0f} s wall on {where}{busy}" if wall is not None else ""
    return (
        f"{info.get('mode', '?')}: {hw}{', ' + lengths if lengths else ''}; {date}; `{cmd}`"
        f"{_seeds_note(d)}{took}"
    )


def _seeds_note(d: dict[str, Any]) -> str:
    """How many seeds the cells summarize ('' for a result file from before seeds)."""
    seeds = d.get("seeds")
    if not seeds:
        return ""
    if seeds["n"] == 1:
        return f"; 1 seed ({seeds['seeds'][0]}), no interval"
    return f"; {seeds['n']} seeds, mean [95% Student-t interval]"


def latest(pattern_dirs: Iterable[Path], name: str) -> Path | None:
    """The newest ``name``.json under the given directories."""
    found = [p for d in pattern_dirs if d.is_dir() for p in d.rglob(f"{name}.json")]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def collect(dirs: list[Path]) -> list[tuple[str, Path]]:
    """(figure, result file) for every figure found in ``dirs`` (or the default locations)."""
    if dirs:
        return [(n, d / f"{n}.json") for d in dirs for n in FIGURES if (d / f"{n}.json").is_file()]
    roots = [ROOT / "outputs" / "paper_repro", ROOT / "multirun" / "paper_repro"]
    out = []
    for name in FIGURES:
        sub = [r / name for r in roots] + [roots[0] / f"{name}_real"]  # e.g. fig16_real
        found = (latest([s], name) for s in sub)  # simulated, multirun, then real
        out += [(name, path) for path in dict.fromkeys(p for p in found if p is not None)]
    return out


def table(results: list[tuple[str, Path]]) -> str:
    """The markdown table (one block per result file, its provenance under it)."""
    lines = []
    for name, path in results:
        d = json.loads(path.read_text())
        lines.append(f"\n**{name}** — {source(d)}\n")
        lines.append("| quantity | ours | paper | check |")
        lines.append("|---|---|---|---|")
        for q, ours, paper, check in FIGURES[name](d):
            lines.append(f"| {q} | {ours} | {paper} | {check} |")
    return "\n".join(lines) + "\n"


BLOCK = re.compile(r"^\*\*(\w+)\*\* — (\w+):", re.MULTILINE)  # "**fig12** — real: ..."


def blocks(text: str) -> dict[tuple[str, str], str]:
    """The table's blocks by (figure, mode), in order."""
    starts = [m.start() for m in BLOCK.finditer(text)] + [len(text)]
    out = {}
    for a, b in zip(starts, starts[1:]):
        m = BLOCK.match(text, a)
        out[(m.group(1), m.group(2))] = text[a:b].strip("\n")
    return out


def merge(old: str, new: str) -> str:
    """The old table with the new blocks in place of those of the same figure and mode (new
    figures appended): a figure that was not rerun keeps its dated block."""
    merged = {**blocks(old), **blocks(new)}
    return "".join(f"\n{block}\n" for block in merged.values())


def update_readme(text: str, readme: Path = README) -> None:
    """Merge the new blocks into the table between the markers (append the markers if
    missing)."""
    body = readme.read_text() if readme.exists() else f"# Paper reproduction\n\n{START}\n{END}\n"
    if START not in body:
        body += f"\n{START}\n{END}\n"
    head, rest = body.split(START, 1)
    old, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{merge(old, text)}{END}{tail}")


def main(argv: list[str]) -> None:
    """Collect the results and rewrite the README table."""
    results = collect([Path(a) for a in argv])
    if not results:
        raise SystemExit("no figure results found; run the figure scripts first")
    update_readme(table(results))
    for name, path in results:
        print(f"{name}: {path}")
    print(f"updated {README}")


if __name__ == "__main__":
    main(sys.argv[1:])
