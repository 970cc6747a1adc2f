"""PNG plots of a `solo bench` report (matplotlib, no display needed): latency CDF, TPOT distribution,
accept length per request, per-position acceptance; one line or bar set per configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = ("latency_cdf.png", "tpot_hist.png", "accept_length.png", "per_position_acceptance.png")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("plots need matplotlib: pip install matplotlib, or pass --no-plots.") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_all(rep: dict[str, Any], out: Path) -> list[Path]:
    """Write the four plots into ``out``; returns their paths."""
    plt = _pyplot()
    configs = rep["configs"]
    w = rep["workload"]
    subtitle = f"{w.get('name')}, {w.get('requests')} requests"
    paths = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, s in configs.items():
        e2el = sorted(s["per_request"]["e2el_s"])
        if e2el:
            ys = [0.0] + [(i + 1) / len(e2el) for i in range(len(e2el))]
            ax.step([e2el[0], *e2el], ys, where="post", label=name)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Latency CDF ({subtitle})")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, PLOTS[0])

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    series = {n: [t * 1e3 for t in s["per_request"]["tpot_s"] if t is not None] for n, s in configs.items()}
    allv = sorted(v for vs in series.values() for v in vs)
    if allv:
        hi = allv[min(len(allv) - 1, int(0.99 * len(allv)))]  # keep the outliers from flattening the bulk
        bins = [allv[0] + (hi - allv[0]) * k / 40 for k in range(41)] if hi > allv[0] else 10
        for name, vs in series.items():
            ax.hist([min(v, hi) for v in vs], bins=bins, alpha=0.55, label=name)
    ax.set_xlabel("TPOT (ms), values above P99 in the last bin")
    ax.set_ylabel("requests")
    ax.set_title(f"TPOT distribution ({subtitle})")
    ax.legend()
    save(fig, PLOTS[1])

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, s in configs.items():
        pr = s["per_request"]
        pts = [(i, a) for i, a in zip(pr["index"], pr["accept_length"], strict=True) if a is not None]
        if pts:
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], ".", ms=3, label=f"{name} (mean {s['accept_length']:.2f})"
            )
    ax.set_xlabel("request")
    ax.set_ylabel("accept length (tokens per verification)")
    ax.set_title(f"Accept length per request ({subtitle})")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative decoding measured", ha="center", va="center", transform=ax.transAxes)
    save(fig, PLOTS[2])

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    spec = {n: s["per_position_acceptance"] for n, s in configs.items() if s.get("per_position_acceptance")}
    width = 0.8 / max(len(spec), 1)
    for k, (name, per) in enumerate(spec.items()):
        ax.bar([i + k * width for i in range(len(per))], per, width=width, label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of rounds accepted")
    ax.set_ylim(0, 1)
    ax.set_title(f"Per-position acceptance ({subtitle})")
    if spec:
        ax.legend()
        ax.set_xticks([i + width * (len(spec) - 1) / 2 for i in range(max(len(p) for p in spec.values()))])
        ax.set_xticklabels([str(i) for i in range(max(len(p) for p in spec.values()))])
    else:
        ax.text(0.5, 0.5, "no speculative decoding measured", ha="center", va="center", transform=ax.transAxes)
    save(fig, PLOTS[3])
    return paths
