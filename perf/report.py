"""Summaries of measured levels: percentiles, the printed table, the JSON document and the PNG plots."""
from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

PERCENTILES = (50, 95, 99)


def _pct(values: list[float], scale: float) -> dict[str, float | None]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(np.percentile(vals, p)) * scale for p in PERCENTILES}


def summarize(profile: str, concurrency: int, timings: list, wall: float, kv_peak: float | None) -> dict:
    ok = [t for t in timings if t.error is None]
    out_tokens = sum(t.output_tokens for t in ok)
    return {
        "profile": profile, "concurrency": concurrency, "requests": len(timings), "errors": len(timings) - len(ok),
        "wall_s": wall, "output_tokens": out_tokens, "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "output_tok_s": out_tokens / wall, "requests_s": len(ok) / wall,
        "ttft_ms": _pct([t.ttft for t in ok], 1e3), "itl_ms": _pct([t.itl for t in ok], 1e3),
        "e2e_s": _pct([t.e2e for t in ok], 1.0), "kv_peak": kv_peak,
        "max_gap_ms": _pct([t.max_gap for t in ok], 1e3),
        "responses_per_token": sum(t.responses for t in ok) / out_tokens if out_tokens else None,
        "timings": [asdict(t) for t in timings],
    }


def _fmt(v, digits=1):
    return "n/a" if v is None else f"{v:.{digits}f}"


def _aligned(head, rows) -> list[str]:
    """`head` and `rows` (tuples of strings) as lines of left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head, *rows]]


def table(levels: list[dict], baselines: list[dict]) -> str:
    head = ("profile", "conc", "reqs", "err", "TTFT ms p50/p95/p99", "ITL ms p50/p95/p99", "E2E s p50/p95/p99",
            "out tok/s", "req/s", "peak KV", "resp/tok", "max gap ms p50/p99")
    rows = []
    for lv in levels:
        rows.append((
            lv["profile"], str(lv["concurrency"]), str(lv["requests"]), str(lv["errors"]),
            "/".join(_fmt(lv["ttft_ms"][f"p{p}"]) for p in PERCENTILES),
            "/".join(_fmt(lv["itl_ms"][f"p{p}"], 2) for p in PERCENTILES),
            "/".join(_fmt(lv["e2e_s"][f"p{p}"], 2) for p in PERCENTILES),
            _fmt(lv["output_tok_s"]), _fmt(lv["requests_s"], 2),
            "n/a" if lv["kv_peak"] is None else f"{lv['kv_peak'] * 100:.0f}%",
            _fmt(lv["responses_per_token"], 2),
            "/".join(_fmt(lv["max_gap_ms"][f"p{p}"]) for p in (50, 99))))
    lines = _aligned(head, rows)
    if baselines:
        lines.append("")
        lines.append(f"baselines on the {baselines[0]['profile']} profile (same prompts and output lengths):")
        for b in baselines:
            lines.append(f"  {b['name']:24s} {b['output_tok_s']:9.1f} out tok/s   this server: "
                         f"{b['server_ratio']:.2f}x")
    return "\n".join(lines)


def comparison(levels: list[dict], baselines: list[dict], profile: str, entry_point: str) -> str:
    """One row per engine on the baselines' requests (this server first): output tok/s, mean TTFT, and the ratio
    to transformers' static batches and to each vLLM run present; then served against the engine alone."""
    level = next(lv for lv in levels if lv["profile"] == profile)
    ttfts = [t["ttft"] for t in level["timings"] if t["error"] is None]
    rows = [{"name": f"served ({entry_point}, gRPC stream)", "output_tok_s": level["output_tok_s"],
             "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts) if ttfts else None}] + baselines
    refs = [b for b in baselines if b["name"].startswith("hf_static")] + \
           [b for b in baselines if b["name"].startswith("vllm")]
    head = ["engine", "out tok/s", "mean TTFT ms"] + [f"vs {r['name']}" for r in refs]
    body = [[r["name"], _fmt(r["output_tok_s"]), _fmt(r.get("ttft_mean_ms"), 0)] +
            [f"{r['output_tok_s'] / ref['output_tok_s']:.2f}" for ref in refs] for r in rows]
    lines = [f"engines on the {profile} profile's requests ({level['output_tokens']} output tokens):"]
    lines += ["  " + line for line in _aligned(head, body)]
    alone = next((b for b in baselines if b["name"] == "engine_alone"), None)
    if alone is not None:
        lines.append(f"served / engine alone: {level['output_tok_s'] / alone['output_tok_s']:.2f}")
    return "\n".join(lines)


def against(levels: list[dict], theirs: list[dict], name: str) -> str:
    """Level by level, this server against another one measured on the same plan: output tok/s and their ratio,
    TTFT and inter-token p50 side by side."""
    head = ("profile", "conc", "out tok/s", name, "ratio", "TTFT p50 ms", name, "ITL p50 ms", name)
    rows = []
    for mine, other in zip(levels, theirs):
        if (mine["profile"], mine["concurrency"]) != (other["profile"], other["concurrency"]):
            raise ValueError(f"levels differ: {mine['profile']} c={mine['concurrency']} against "
                             f"{other['profile']} c={other['concurrency']}")
        rows.append((mine["profile"], str(mine["concurrency"]), _fmt(mine["output_tok_s"]),
                     _fmt(other["output_tok_s"]), f"{mine['output_tok_s'] / other['output_tok_s']:.2f}x",
                     _fmt(mine["ttft_ms"]["p50"]), _fmt(other["ttft_ms"]["p50"]),
                     _fmt(mine["itl_ms"]["p50"], 2), _fmt(other["itl_ms"]["p50"], 2)))
    return "\n".join(_aligned(head, rows))


def plot(levels: list[dict], path_prefix: str, others: dict[str, list[dict]] | None = None,
         name: str = "this server") -> list[str]:
    """Two PNGs: latency against throughput as concurrency rises (with `others`' levels, other servers measured on
    the same plan, as dashed curves on the same axes; `name` labels ours then), and the distribution of TTFT per
    profile."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    # low and high send the same requests at different concurrency: one curve.
    series = {"low": "low + high", "high": "low + high"}
    for server, server_levels, style in [(None, levels, "-")] + [(n, lv, "--") for n, lv in (others or {}).items()]:
        for label_ in dict.fromkeys(series.get(lv["profile"], lv["profile"]) for lv in server_levels):
            pts = [lv for lv in server_levels if series.get(lv["profile"], lv["profile"]) == label_]
            x = [lv["output_tok_s"] for lv in pts]
            for ax, key, label in ((axes[0], "ttft_ms", "TTFT p50 (ms)"),
                                   (axes[1], "itl_ms", "inter-token p50 (ms)")):
                y = [lv[key]["p50"] for lv in pts]
                ax.plot(x, y, style, marker="o", label=f"{server or name}: {label_}" if others else label_)
                for xi, yi, lv in zip(x, y, pts):
                    if yi is not None:
                        ax.annotate(f"c={lv['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                                    fontsize=8)
                ax.set_xlabel("output tokens/s")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Latency against throughput as concurrency rises")
    fig.tight_layout()
    throughput_png = f"{path_prefix}throughput_latency.png"
    fig.savefig(throughput_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for profile in dict.fromkeys(lv["profile"] for lv in levels):
        ttft = [t["ttft"] * 1e3 for lv in levels if lv["profile"] == profile for t in lv["timings"]
                if t["error"] is None]
        if ttft:
            ax.hist(ttft, bins=min(40, max(5, len(ttft) // 2)), histtype="step", linewidth=1.5, label=profile)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("requests")
    ax.set_title("TTFT distribution")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    ttft_png = f"{path_prefix}ttft_distribution.png"
    fig.savefig(ttft_png, dpi=110)
    plt.close(fig)
    return [throughput_png, ttft_png]
