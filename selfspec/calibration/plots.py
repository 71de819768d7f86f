"""Calibration plots, readable at a glance: acceptance vs draft depth (knee marked), speedup vs γ
(measured beside predicted), and per-bucket acceptance as a heatmap."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_calibration_plots(profile, estimates, out_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overall = {e.temperature: e for e in estimates if e.category == "all" and e.length_bucket == "all"}
    depths = sorted(int(n) for n in profile.draft_cost if n.isdigit())
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, e in sorted(overall.items()):
        ax.plot(depths, [e.alpha[str(n)] for n in depths], marker="o", label=f"T={t:g}")
    for n, head in getattr(profile, "draft_heads", {}).items():  # where a trained head drafts: the plain exit beside it
        plain = [
            head["acceptance"][f"{t:g}"]["alpha_plain_exit"] for t in sorted(overall) if f"{t:g}" in head["acceptance"]
        ]
        ax.plot(
            [int(n)] * len(plain),
            plain,
            "kx",
            label=f"N={n} plain exit (the points above use the {head['kind']} draft head)",
        )
    ax.axvline(profile.knee, color="gray", linestyle="--", label=f"knee N={profile.knee}")
    ax.axvline(
        profile.best_draft_layers,
        color="green",
        linestyle=":",
        label=f"best predicted speedup N={profile.best_draft_layers}",
    )
    ax.set(
        xlabel="draft depth N (layers)",
        ylabel="acceptance per drafted token",
        title=f"{profile.model}: acceptance vs N",
        ylim=(0, 1),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "acceptance_vs_depth.png"))

    t0 = min(overall)
    e = overall[t0]
    sources = [str(profile.best_draft_layers)] + [n for n in e.speedup if not n.isdigit()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sources:
        gammas = sorted(int(g) for g in e.speedup[n])
        label = f"exit N={n}" if n.isdigit() else n
        ax.plot(gammas, [e.speedup[n][str(g)] for g in gammas], marker="o", label=f"{label}: predicted")
    best = e.best()[0]
    measured = [
        v for v in profile.validation if v.get("source") == best and v["category"] == "all" and v["temperature"] == t0
    ]
    if measured:
        ax.plot(
            [v["gamma"] for v in measured],
            [v["measured_speedup"] for v in measured],
            marker="s",
            linestyle="none",
            label=f"{best}: measured (decoding time)",
        )
    ax.axhline(1.0, color="gray", linestyle="--", label="plain decoding")
    ax.set(
        xlabel="γ (draft tokens per round)", ylabel="speedup over plain", title=f"speedup vs γ per drafter, T={t0:g}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "speedup_vs_gamma.png"))

    cats = sorted({x.category for x in estimates if x.category != "all"}) + ["all"]
    temps = sorted(overall)
    n = str(profile.knee)
    grid = {(x.category, x.temperature): x.alpha[n] for x in estimates if x.length_bucket == "all"}
    fig, ax = plt.subplots(figsize=(1.2 * len(temps) + 3, 0.4 * len(cats) + 1.5))
    data = [[grid.get((c, t), float("nan")) for t in temps] for c in cats]
    im = ax.imshow(data, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for i, row in enumerate(data):
        for j, val in enumerate(row):
            ax.text(j, i, f"{val:.2f}", ha="center", va="center", color="white" if val < 0.6 else "black", fontsize=8)
    ax.set_xticks(range(len(temps)), [f"T={t:g}" for t in temps])
    ax.set_yticks(range(len(cats)), cats)
    ax.set_title(f"acceptance per bucket at the knee N={n}")
    fig.colorbar(im, ax=ax)
    paths.append(_save(fig, out / "acceptance_heatmap.png"))
    return paths


def write_train_draft_plot(report: dict, path: str | Path) -> Path:
    """Held-out greedy acceptance vs exit layer per adapter kind (the plain exit beside), and each
    head's draft cost c and best predicted speedup."""
    plt = _pyplot()
    results = report["results"]
    kinds = sorted({r["kind"] for r in results})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    plain = sorted({(r["draft_layers"], r["plain_exit"]["top1_agreement"]) for r in results})
    ax1.plot([n for n, _ in plain], [a for _, a in plain], "k--", marker="x", label="plain exit")
    for kind in kinds:
        rows = sorted((r["draft_layers"], r) for r in results if r["kind"] == kind)
        ns = [n for n, _ in rows]
        ax1.plot(ns, [r["heldout"]["acceptance"]["0"] for _, r in rows], marker="o", label=kind)
        ax2.plot(ns, [r["choice"]["predicted_speedup"] for _, r in rows], marker="o", label=f"{kind}: speedup")
        ax2.plot(ns, [r["choice"]["c"] for _, r in rows], marker=".", linestyle=":", label=f"{kind}: c")
    ax1.set(xlabel="exit layer N", ylabel="held-out acceptance (T=0)", title="Draft exits: trained vs plain")
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2.set(xlabel="exit layer N", title="Draft cost c and best predicted speedup (over γ)")
    ax1.legend()
    ax2.legend(fontsize=7)
    return _save(fig, Path(path))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
