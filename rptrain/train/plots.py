"""curves.png: loss and accuracy (or perplexity), train vs test, as in the tutorial.

Per epoch once an epoch has finished (the tutorial's plot); per log step before that, so short
runs (trainer.max_steps) get a plot too.
"""
from __future__ import annotations

from pathlib import Path


def plot_curves(records: list[dict], path: Path, metric: str = "acc") -> None:
    # A bare Figure, not pyplot: no GUI backend, no global state, works on headless nodes.
    # Imported here: matplotlib costs ~0.5 s that --cfg and rejected command lines need not pay.
    from matplotlib.figure import Figure

    label = {"acc": "Accuracy", "ppl": "Perplexity"}[metric]
    epochs = [r for r in records if r["kind"] == "epoch"]
    fig = Figure(figsize=(12, 5))
    axes = fig.subplots(1, 2)
    if epochs:
        x = [r["epoch"] for r in epochs]
        series = {
            "loss": [("Train Loss", x, [r.get("train_loss") for r in epochs]), ("Test Loss", x, [r.get("test_loss") for r in epochs])],
            metric: [(f"Train {label}", x, [r.get(f"train_{metric}") for r in epochs]),
                     (f"Test {label}", x, [r.get(f"test_{metric}") for r in epochs])],
        }
        xlabel = "Epoch"
    else:
        train = [r for r in records if r["kind"] == "train"]
        test = [r for r in records if r["kind"] == "eval"]
        series = {
            key: [(f"Train {name}", [r["step"] for r in train], [r.get(key) for r in train]),
                  (f"Test {name}", [r["step"] for r in test], [r.get(key) for r in test])]
            for key, name in (("loss", "Loss"), (metric, label))
        }
        xlabel = "Step"
    for ax, (key, lines) in zip(axes, series.items()):
        for name, xs, ys in lines:
            points = [(a, b) for a, b in zip(xs, ys) if b is not None]
            if points:
                ax.plot(*zip(*points), label=name, marker="o" if len(points) < 3 else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Loss" if key == "loss" else label)
        ax.set_title("Loss Curve" if key == "loss" else f"{label} Curve")
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)
