"""The PNG of `moegraph profile --plot`: the NVML memory timeline (eager, capture and graph
phases shaded; the graph pools' bytes from GraphSession.pools() as a band under the graph
phase) and per-scope eager vs replay ms. matplotlib is optional and imported only here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import MoegraphError
from ..io.outputs import write_atomically

GIB = 2**30
PHASE_COLOURS = {"eager": "#dbe9f6", "capture": "#eeeeee", "graph": "#dcf0dc",
                 "per-scope": "#f6ecd9"}


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise MoegraphError("--plot needs matplotlib, which is not installed "
                            "(pip install matplotlib)")


def profile_plot(path: str, result: dict, timeline: dict) -> None:
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_ms) = plt.subplots(2, 1, figsize=(12, 8.5),
                                        gridspec_kw={"height_ratios": [3, 2]})
    t, used = timeline.get("t_s", []), timeline.get("used_bytes", [])
    marks = timeline.get("marks", [])
    end = t[-1] if t else (marks[-1]["t_s"] if marks else 1.0)
    for i, m in enumerate(marks):
        stop = marks[i + 1]["t_s"] if i + 1 < len(marks) else end
        ax_mem.axvspan(m["t_s"], stop, color=PHASE_COLOURS.get(m["phase"], "#f4f4f4"),
                       zorder=0)
        ax_mem.text(m["t_s"], 1.0, f" {m['phase']}", transform=ax_mem.get_xaxis_transform(),
                    va="top", fontsize=8)
    graph = next((i for i, m in enumerate(marks) if m["phase"] == "graph"), None)
    if graph is not None and result.get("pools"):
        start = marks[graph]["t_s"]
        stop = marks[graph + 1]["t_s"] if graph + 1 < len(marks) else end
        base = 0.0
        for k, pool in enumerate(result["pools"]):
            height = pool["bytes"] / GIB
            ax_mem.fill_between([start, stop], base, base + height, alpha=0.55, hatch="//",
                                color=f"C{2 + k % 6}", zorder=1,
                                label=f"pool {pool['name']}: {height:.2f} GiB")
            base += height
    if t:
        ax_mem.plot(t, [u / GIB for u in used], color="C0", lw=1.4, zorder=3,
                    label="NVML memory used")
        ax_util = ax_mem.twinx()
        ax_util.plot(t, timeline.get("util_pct", []), color="C1", lw=0.7, alpha=0.5)
        ax_util.set_ylabel("GPU utilisation %", color="C1")
        ax_util.set_ylim(0, 105)
    else:
        ax_mem.text(0.5, 0.5, result.get("nvml", {}).get("note") or "no NVML samples",
                    transform=ax_mem.transAxes, ha="center", va="center")
    for key, style, label in (("eager_peak_reserved", "--", "eager peak reserved (torch)"),
                              ("graph_peak_reserved", ":", "graph peak reserved (torch)")):
        if result.get(key):
            ax_mem.axhline(result[key] / GIB, ls=style, color="k", lw=0.9, label=label)
    tops = [u / GIB for u in used] + [result.get(k, 0) / GIB for k in
                                      ("eager_peak_reserved", "graph_peak_reserved")]
    ax_mem.set_ylim(0, max(tops + [1.0]) * 1.15)
    ax_mem.set_xlabel("seconds")
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title(f"{result['profile']}: memory, eager vs graph "
                     f"(pool {result.get('pool', '?')})")
    ax_mem.legend(loc="center left", fontsize=8)

    scopes = result.get("scopes", [])
    names = [s["name"] for s in scopes]
    x = range(len(scopes))
    ax_ms.bar([i - 0.2 for i in x], [s["eager_ms"] or 0 for s in scopes], width=0.4,
              label="eager fwd+bwd")
    ax_ms.bar([i + 0.2 for i in x], [s["replay_ms"] or 0 for s in scopes], width=0.4,
              label="graph replay fwd+bwd")
    ax_ms.set_xticks(list(x))
    ax_ms.set_xticklabels(names, rotation=60 if len(names) > 6 else 0, ha="right"
                          if len(names) > 6 else "center", fontsize=8)
    ax_ms.set_ylabel("ms")
    ax_ms.set_title("per scope: eager vs replay")
    ax_ms.legend(fontsize=8)
    fig.tight_layout()
    fmt = Path(path).suffix.lstrip(".").lower() or "png"  # the temp file's name has no suffix
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))
    plt.close(fig)
