"""Turning the benchmark's raw measurements into tables, verdicts, RESULTS.md and a plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .peers import LIBS

PCTX = "parallelctx"
PEER_LABEL = {"parallelctx": "parallelctx", "megatron": "Megatron-core", "devicemesh": "DeviceMesh"}
# Query rows: (library, query name) -> short label; the first four are parallelctx's targets.
FAST_QUERIES = ("get_local_rank(mode)", "get_world_size(mode)", "get_group(mode)", "gpc.tensor.rank")
MEGATRON_RANK = "get_tensor_model_parallel_rank()"
MESH_RANK = 'mesh.get_local_rank("tp")'

# Targets of issue 5, as ratios parallelctx / peer (start-up) or peer / parallelctx (queries).
TARGET_VS_MEGATRON = 1 / 5
TARGET_VS_MESH = 1 / 2
QUERY_NS_LIMIT = 100.0
QUERY_VS_MEGATRON = 3.0
QUERY_VS_MESH = 20.0


def spread(values: list[float]) -> tuple[float, float, float]:
    """Return (median, min, max) of ``values``.

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("no values to summarise; did every benchmark round fail?")
    return statistics.median(values), min(values), max(values)


def paired_ratio(run: dict[str, Any], peer: str, key: str) -> float:
    """Median over rounds of parallelctx's ``key`` divided by ``peer``'s in the same round."""
    ratios = []
    for rnd in run["rounds"]:
        by_lib = {rec["lib"]: rec for rec in rnd}
        if PCTX in by_lib and peer in by_lib and by_lib[peer][key] > 0:
            ratios.append(by_lib[PCTX][key] / by_lib[peer][key])
    return statistics.median(ratios) if ratios else float("nan")


def records(run: dict[str, Any], lib: str) -> list[dict[str, Any]]:
    """Every round's record of ``lib`` in one start-up run."""
    return [rec for rnd in run["rounds"] for rec in rnd if rec["lib"] == lib]


def _ms(values: list[float]) -> str:
    med, lo, hi = spread(values)
    return f"{med * 1e3:.1f} [{lo * 1e3:.1f}–{hi * 1e3:.1f}]"


def _calls(recs: list[dict[str, Any]]) -> str:
    lo = min(r["calls_min"] for r in recs)
    hi = max(r["calls_max"] for r in recs)
    return str(hi) if lo == hi else f"{lo}–{hi}"


def _members(recs: list[dict[str, Any]]) -> str:
    lo = min(r["member_groups_min"] for r in recs)
    hi = max(r["member_groups_max"] for r in recs)
    return str(hi) if lo == hi else f"{lo}–{hi}"


def startup_table(runs: list[dict[str, Any]]) -> str:
    """Markdown table of every start-up run: one row per library and run."""
    head = (
        "| world | layout | gloo init | library | create ms, median [min–max] | "
        "to first collective ms | new_group calls / rank | groups joined / rank | "
        "parallelctx ÷ this, create | parallelctx ÷ this, first collective |\n"
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for run in runs:
        layout = f"tp{run['tensor']} pp{run['pipeline']} dp{run['world_size'] // (run['tensor'] * run['pipeline'])}"
        mode = "lazy" if run["lazy_init"] else "eager"
        for lib in LIBS:
            recs = records(run, lib)
            if not recs:
                continue
            if lib == PCTX:
                ratio_c = ratio_f = "1"
            else:
                ratio_c = f"{paired_ratio(run, lib, 'create_s'):.2f}"
                ratio_f = f"{paired_ratio(run, lib, 'first_collective_s'):.2f}"
            rows.append(
                f"| {run['world_size']} | {layout} | {mode} | {PEER_LABEL[lib]} | "
                f"{_ms([r['create_s'] for r in recs])} | {_ms([r['first_collective_s'] for r in recs])} | "
                f"{_calls(recs)} | {_members(recs)} | {ratio_c} | {ratio_f} |"
            )
    return head + "\n".join(rows) + "\n"


def query_ns(runs: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Median nanoseconds per call of every (library, query) over every run and round."""
    samples: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for rnd in run["rounds"]:
            for rec in rnd:
                for name, ns in rec["queries_ns"].items():
                    samples.setdefault((rec["lib"], name), []).append(ns)
    return {key: statistics.median(vals) for key, vals in samples.items()}


def query_table(runs: list[dict[str, Any]]) -> str:
    """Markdown table of query costs, with each one's ratio to parallelctx's get_local_rank."""
    ns = query_ns(runs)
    base = ns.get((PCTX, "get_local_rank(mode)"), float("nan"))
    head = "| library | query | ns per call | ÷ parallelctx get_local_rank(mode) |\n|---|---|---:|---:|\n"
    rows = [
        f"| {PEER_LABEL[lib]} | `{name}` | {value:.1f} | {value / base:.1f}x |"
        for (lib, name), value in sorted(ns.items(), key=lambda kv: (LIBS.index(kv[0][0]), kv[1]))
    ]
    return head + "\n".join(rows) + "\n"


def sim_table(sims: list[dict[str, Any]]) -> str:
    """Markdown table of the simulated start-ups, one row per world size."""
    head = (
        "| library | world | sizes (tp, pp, cp, ep) | rank | start-up ms, median [min–max] | peak memory KiB | "
        "kept KiB | torch alone, same groups: ms / kept KiB | "
        "new_group calls | layout of whole world ms | groups to lists ms | fake init ms |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for s in sims:
        z = s["sizes"]
        rows.append(
            f"| {PEER_LABEL[s.get('lib', PCTX)]} | {s['world_size']:,} | {z['tensor']}, {z['pipeline']}, {z['context']}, {z['expert']} | "
            f"{s['rank']:,} | {s['startup_s'] * 1e3:.2f} [{s['startup_min_s'] * 1e3:.2f}–"
            f"{s['startup_max_s'] * 1e3:.2f}] | {s['peak_bytes'] / 1024:.0f} | "
            f"{s['kept_bytes'] / 1024:.0f} | "
            + (
                f"{s['torch_alone_s'] * 1e3:.2f} / {s['torch_alone_kept_bytes'] / 1024:.0f} | "
                if "torch_alone_s" in s
                else "— | "
            )
            + f"{s['group_creations']} | "
            + (
                f"{s['layout_s'] * 1e3:.1f} | {s['to_lists_s'] * 1e3:.1f} | "
                if s.get("lib", PCTX) == PCTX
                else "— | — | "
            )
            + f"{s['fake_init_s'] * 1e3:.1f} |"
        )
    return head + "\n".join(rows) + "\n"


def _mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def verdicts(runs: list[dict[str, Any]], sims: list[dict[str, Any]]) -> list[str]:
    """One line per target of issue 5: the measured value and whether it was met."""
    lines = []
    for run in runs:
        mode = "lazy" if run["lazy_init"] else "eager"
        w = run["world_size"]
        for peer, target in (("megatron", TARGET_VS_MEGATRON), ("devicemesh", TARGET_VS_MESH)):
            if not records(run, peer):
                continue
            r = paired_ratio(run, peer, "create_s")
            f = paired_ratio(run, peer, "first_collective_s")
            lines.append(
                f"start-up, world {w}, {mode} gloo: parallelctx/{PEER_LABEL[peer]} = {r:.2f} "
                f"(target ≤ {target:.2f}): {_mark(r <= target)}; to first collective {f:.2f}"
            )
        calls = max(rec["calls_max"] for rec in records(run, PCTX))
        joined = max(rec["member_groups_max"] for rec in records(run, PCTX))
        lines.append(
            f"group creations per rank, world {w}, {mode}: {calls} calls for {joined} distinct "
            f"groups joined: {_mark(calls <= joined)}"
        )
    ns = query_ns(runs)
    for name in FAST_QUERIES:
        if (PCTX, name) in ns:
            v = ns[(PCTX, name)]
            lines.append(
                f"query `{name}`: {v:.1f} ns (target < {QUERY_NS_LIMIT:.0f}): {_mark(v < QUERY_NS_LIMIT)}"
            )
    base = ns.get((PCTX, "get_local_rank(mode)"))
    if base:
        for (lib, name), target in (
            ((("megatron", MEGATRON_RANK)), QUERY_VS_MEGATRON),
            ((("devicemesh", MESH_RANK)), QUERY_VS_MESH),
        ):
            if (lib, name) in ns:
                x = ns[(lib, name)] / base
                lines.append(
                    f"query vs `{name}`: {x:.1f}x faster (target ≥ {target:.0f}x): {_mark(x >= target)}"
                )
    own = sorted((s for s in sims if s.get("lib", PCTX) == PCTX), key=lambda s: s["world_size"])
    own_at = {s["world_size"]: s for s in own}
    for lib in LIBS[1:]:
        peer = [s for s in sims if s.get("lib") == lib and s["world_size"] in own_at]
        if peer:
            p = max(peer, key=lambda s: s["world_size"])
            mine = own_at[p["world_size"]]
            lines.append(
                f"simulated start-up at {p['world_size']:,} ranks: {PEER_LABEL[lib]} takes "
                f"{p['startup_s'] / mine['startup_s']:.0f}x parallelctx's time "
                f"({p['startup_s'] * 1e3:.0f} ms vs {mine['startup_s'] * 1e3:.1f} ms; "
                f"{p['group_creations']} vs {mine['group_creations']} new_group calls)"
            )
    if own:
        sims = own
        t = [s["startup_s"] for s in sims]
        m = [s["peak_bytes"] for s in sims]
        lay = max(s["layout_s"] for s in sims)
        lines.append(
            f"simulated per-rank time, largest/smallest world: {t[-1] / t[0]:.2f} (target ≤ 2): {_mark(t[-1] / t[0] <= 2)}"
        )
        lines.append(
            f"simulated per-rank peak memory, largest/smallest world: {m[-1] / m[0]:.2f} (target ≤ 2): {_mark(m[-1] / m[0] <= 2)}"
        )
        if all("torch_alone_s" in s for s in sims):
            dt = [max(s["startup_s"] - s["torch_alone_s"], 0.0) for s in sims]
            dk = [max(s["kept_bytes"] - s["torch_alone_kept_bytes"], 0) for s in sims]
            lines.append(
                f"parallelctx's share above torch alone making the same groups: time "
                f"{dt[0] * 1e3:.2f} → {dt[-1] * 1e3:.2f} ms ({dt[-1] / max(dt[0], 1e-9):.2f}x, target ≤ 2: "
                f"{_mark(dt[-1] <= 2 * dt[0])}), kept memory {dk[0] / 1024:.0f} → {dk[-1] / 1024:.0f} KiB "
                f"({dk[-1] / max(dk[0], 1):.2f}x, target ≤ 2: {_mark(dk[-1] <= 2 * dk[0])}); "
                f"torch alone grows {sims[-1]['torch_alone_s'] / sims[0]['torch_alone_s']:.1f}x in time and "
                f"{sims[-1]['torch_alone_kept_bytes'] / max(sims[0]['torch_alone_kept_bytes'], 1):.1f}x in kept memory"
            )
        same = [s for s in sims if s["sizes"] == sims[-1]["sizes"]]
        if len(same) > 1 and same[0] is not sims[0]:
            lines.append(
                f"same sizes ({same[0]['world_size']:,} vs {same[-1]['world_size']:,} ranks): per-rank time "
                f"{same[-1]['startup_s'] / same[0]['startup_s']:.2f}x, peak memory "
                f"{same[-1]['peak_bytes'] / same[0]['peak_bytes']:.2f}x"
            )
        lines.append(
            f"layout of the whole world, slowest: {lay * 1e3:.1f} ms (target < 1 s): {_mark(lay < 1)}"
        )
    return lines


def plot(runs: list[dict[str, Any]], sims: list[dict[str, Any]], path: Path) -> None:
    """Write a PNG of start-up seconds against world size: three libraries (eager and lazy
    gloo, medians with min–max bars) and the simulated parallelctx curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    colours = {"parallelctx": "tab:green", "megatron": "tab:red", "devicemesh": "tab:blue"}
    for lazy in (False, True):
        chosen = sorted((r for r in runs if r["lazy_init"] == lazy), key=lambda r: r["world_size"])
        if not chosen:
            continue
        for lib in LIBS:
            xs, med, lo, hi = [], [], [], []
            for run in chosen:
                recs = records(run, lib)
                if recs:
                    m, a, b = spread([r["create_s"] for r in recs])
                    xs.append(run["world_size"])
                    med.append(m)
                    lo.append(m - a)
                    hi.append(b - m)
            if xs:
                ax.errorbar(
                    xs,
                    med,
                    yerr=[lo, hi],
                    marker="o",
                    capsize=3,
                    color=colours[lib],
                    linestyle="--" if lazy else "-",
                    label=f"{PEER_LABEL[lib]} ({'lazy' if lazy else 'eager'} gloo)",
                )
    for lib in LIBS:
        sim = sorted((s for s in sims if s.get("lib", PCTX) == lib), key=lambda s: s["world_size"])
        if sim:
            ax.plot(
                [s["world_size"] for s in sim],
                [s["startup_s"] for s in sim],
                marker="s",
                linestyle=":",
                color="black" if lib == PCTX else colours[lib],
                label=f"{PEER_LABEL[lib]}, one rank simulated (fake backend)",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("start-up: default group ready → all groups ready (s)")
    ax.set_title("Process-group start-up, max over ranks (2-core CPU, gloo)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
