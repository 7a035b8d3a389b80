"""Draw docs/figures/timeline.png: what each side does per round in ddp, dpu and acco.

    pip install -e ".[docs]" && python docs/figures/timeline.py
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COMPUTE, COMM = 1.0, 0.8  # one round's compute and communication time (arbitrary units)
COLORS = {"G̃": "#f4a261", "G": "#2a9d8f", "Peek": "#e9c46a", "Opt": "#264653", "wait": "#dddddd"}


def bars(mode: str, rounds: int):
    """(row, start, length, label, color) for each box of ``mode``'s timeline."""
    boxes, t = [], 0.0
    for r in range(rounds):
        if mode == "ddp":
            boxes.append((1, t, COMPUTE, f"G{r}", COLORS["G"]))
            boxes.append((0, t + COMPUTE, COMM, f"Opt → θ{r + 1}", COLORS["Opt"]))
            boxes.append((1, t + COMPUTE, COMM, "idle", COLORS["wait"]))
            t += COMPUTE + COMM
            continue
        if mode == "acco":
            estimate = r % 2 == 0
            label = f"G̃{r // 2}" if estimate else f"+G{r // 2}"
            boxes.append((1, t, COMPUTE, label, COLORS["G̃" if estimate else "G"]))
        else:
            boxes.append((1, t, COMPUTE, f"G{r}", COLORS["G"]))
        if r > 0:  # the previous round's payload is communicated during this round
            if mode == "acco":
                estimate = (r - 1) % 2 == 0
                text = f"Peek → θ̃{r // 2 + 1}" if estimate else f"Opt → θ{(r - 1) // 2 + 1}"
                boxes.append((0, t, COMM, text, COLORS["Peek" if estimate else "Opt"]))
            else:
                boxes.append((0, t, COMM, f"Opt → θ{r}", COLORS["Opt"]))
        t += COMPUTE
    return boxes, t


def main() -> None:
    fig, axes = plt.subplots(3, 1, figsize=(11, 5.2), sharex=True)
    for ax, (mode, title) in zip(axes, [
        ("ddp", "ddp (synchronous ZeRO-1): the worker idles while the network works"),
        ("dpu", "dpu: communication of round k overlaps compute of round k+1 (gradient one step stale)"),
        ("acco", "acco: even rounds compute at the estimate θ̃, odd rounds add the real-θ half on top"),
    ]):  # fmt: skip
        boxes, end = bars(mode, 6 if mode != "ddp" else 4)
        for row, start, length, label, color in boxes:
            ax.broken_barh([(start, length * 0.98)], (row - 0.4, 0.8), color=color)
            dark = color in (COLORS["Opt"], COLORS["G"])
            ax.text(start + length / 2, row, label, ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")  # fmt: skip
        ax.set_yticks([0, 1], ["communication\n(worker thread)", "compute\n(training loop)"])
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylim(-0.6, 1.6)
    axes[-1].set_xlabel("time →  (one box = one round; comm = reduce-scatter → shard step → all-gather)")
    fig.tight_layout()
    out = pathlib.Path(__file__).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
