"""The chart of the shared-mem row (NOTE [ The shared-dataset rows ] in
shared_cases.py): the growth of the workers' unique memory (USS) and of
the program's total PSS, for torch's DataLoader on the plain list and on
detectron2's numpy serialization, and for mpcore's on the plain list and
on the dataset converted, drawn from the JSON of a bench run:

    mpcore bench --only shared-mem --repeat 1 --json mem.json
    python benchmarks/plot_shared_mem.py mem.json docs/shared-mem.svg

Each side's figures are those of its best repeat, as the table's.  The
file is an SVG whose text stays text (searchable, a few KB), or any
format matplotlib writes, by the name's suffix.
"""
import json
import sys

ROW = "shared-mem"
# (side, variant, label) in the order drawn
BARS = (("torch", "plain", "torch, plain list"),
        ("torch", "numpy", "torch, detectron2-style numpy"),
        ("mpcore", "plain", "mpcore, plain list"),
        ("mpcore", "converted", "mpcore, share_dataset=True"))
COLORS = ("#b0413e", "#e0a458", "#7a9cc6", "#2e7d32")
MB = 2**20


def figures(doc):
    """{(side, variant): (USS growth, PSS growth) in MB}, the one copy in
    MB and the row's item and worker counts, from a bench JSON document;
    ValueError when it has no shared-mem row with both sides' figures."""
    row = next((r for r in doc.get("rows", []) if r.get("name") == ROW), None)
    if row is None:
        raise ValueError(f"the JSON has no {ROW!r} row (run `mpcore bench --only {ROW}`)")
    ex = {}
    for side in ("torch", "mpcore"):
        s = row.get(side) or {}
        vals = s.get("values") or []
        if not vals:
            raise ValueError(f"the {ROW!r} row has no figures of {side}'s side: "
                             f"{row.get('errors') or 'it did not run'}")
        ex[side] = s["extra"][vals.index(s["best"])]
    out = {}
    for side, variant, _ in BARS:
        v = ex[side][variant]
        out[(side, variant)] = (v["uss_growth"] / MB, v["pss_growth"] / MB)
    m = ex["mpcore"]
    return out, m["one_copy"] / MB, m["items"], m["workers"]


def plot(doc, path):
    """Writes the chart of doc's shared-mem row to path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs, one, items, workers = figures(doc)
    plt.rcParams["svg.fonttype"] = "none"      # text stays text
    plt.rcParams["svg.hashsalt"] = "mpcore"    # the same ids run after run
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 2.9), sharey=True)
    labels = [label for _, _, label in BARS]
    ys = list(range(len(BARS)))[::-1]
    for k, (ax, title) in enumerate(zip(axes, (f"{workers} workers' unique memory (USS) growth",
                                               "the program's total PSS growth"))):
        vals = [figs[(side, variant)][k] for side, variant, _ in BARS]
        ax.barh(ys, vals, color=COLORS, height=0.65)
        top = max(vals + [one])
        for y, v in zip(ys, vals):
            ax.text(v + top * 0.015, y, f"{v:,.0f} MB", va="center", fontsize=8.5)
        ax.set_ylim(-1.0, len(BARS) - 0.5)
        if k == 1:
            ax.axvline(one, color="black", linestyle="--", linewidth=1)
            ax.text(one, -0.75, f" one copy of the dataset: {one:,.0f} MB", fontsize=8,
                    va="center")
        ax.set_xlim(0, top * 1.28)
        ax.set_title(title, fontsize=9.5)
        ax.set_xlabel("MB", fontsize=8.5)
        ax.tick_params(labelsize=8)
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(labels, fontsize=8.5)
    fig.suptitle(f"A dataset of {items:,} small dicts, {workers} fork workers, one epoch "
                 "(growth from a dataset 1,000x smaller)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None} if str(path).endswith(".svg") else None)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    try:
        plot(doc, argv[1])
    except ValueError as e:
        print(f"plot_shared_mem: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
