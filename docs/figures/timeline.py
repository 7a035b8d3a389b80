"""Draw docs/figures/timeline.png: what each side of one rank does per round in ddp, dpu and acco.

    pip install -e ".[docs]" && python docs/figures/timeline.py

A schematic, not a measurement: one round's compute is 1 time unit and its communication 0.8,
drawn to the engine's schedule (``acco_hooks/engine.py``; ``tests/scenario.py:reference_run``).
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COMPUTE, COMM = 1.0, 0.8  # one round's compute and communication time (arbitrary units)
# The communication of a round: reduce-scatter, the shard step, all-gather (schematic shares).
REDUCE_SCATTER, SHARD_STEP, ALL_GATHER = 0.32, 0.16, 0.32
COLORS = {
    "G̃": "#f4a261", "G": "#2a9d8f", "Peek": "#e9c46a", "Opt": "#264653", "wait": "#dddddd",
    "collective": "#a8c5da",
}  # fmt: skip
COMPUTE_ROW, COMM_ROW = 1, 0


def sub(i: int | str) -> str:
    return str(i).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))


THETA = r"\theta"


def tilde(symbol: str, n: int) -> str:
    """A tilded symbol with subscript n, in mathtext: the default font loses combining tildes
    next to mathtext, so every tilded symbol in a label is drawn the same way."""
    return rf"$\tilde{{{symbol}}}_{{{n}}}$"


def compute_boxes(mode: str, rounds: int):
    """(start, length, label, color, above) of each compute box; ``above`` names the round."""
    boxes, t = [], 0.0
    for r in range(rounds):
        if mode == "ddp":
            boxes.append((t, COMPUTE, f"G{sub(r)} at θ{sub(r)}", COLORS["G"], f"round {r}"))
            boxes.append((t + COMPUTE, COMM, "idle (waits)", COLORS["wait"], ""))
            t += COMPUTE + COMM
            continue
        if mode == "acco":
            if r % 2 == 0:
                label = tilde("G", r // 2) + " at " + tilde(THETA, r // 2)
                color, kind = COLORS["G̃"], "estimate"
            else:
                label, color, kind = f"+G{sub(r // 2)} at θ{sub(r // 2)}", COLORS["G"], "update"
            boxes.append((t, COMPUTE, label, color, f"round {r}: {kind} round"))
        else:  # dpu: round r computes at the parameters of update r - 1
            boxes.append((t, COMPUTE, f"G{sub(r)} at θ{sub(max(r - 1, 0))}", COLORS["G"],
                          f"round {r}"))  # fmt: skip
        t += COMPUTE
    return boxes


def comm_boxes(mode: str, rounds: int):
    """(start, step label, step color, result) of each round's communication."""
    out = []
    for r in range(rounds):
        if mode == "ddp":
            out.append((r * (COMPUTE + COMM) + COMPUTE, "Opt", COLORS["Opt"], f"→ θ{sub(r + 1)}"))
        elif r > 0:  # the previous round's payload is communicated during this round
            start = r * COMPUTE
            if mode == "dpu":
                out.append((start, "Opt", COLORS["Opt"], f"G{sub(r - 1)} → θ{sub(r)}"))
            elif (r - 1) % 2 == 0:  # acco: after an estimate round
                t = (r - 1) // 2
                result = "Σ" + tilde("G", t) + " → " + tilde(THETA, t + 1)
                out.append((start, "Peek", COLORS["Peek"], result))
            else:  # acco: after an update round
                t = (r - 1) // 2
                result = f"Σ(G̃{sub(t)}+G{sub(t)}) → θ{sub(t + 1)}"
                out.append((start, "Opt", COLORS["Opt"], result))
    return out


def draw(ax, mode: str, rounds: int) -> None:
    for start, length, label, color, above in compute_boxes(mode, rounds):
        ax.broken_barh([(start, length * 0.98)], (COMPUTE_ROW - 0.35, 0.7), color=color)
        dark = color == COLORS["G"]
        ax.text(start + length / 2, COMPUTE_ROW, label, ha="center", va="center", fontsize=8,
                color="white" if dark else "black")  # fmt: skip
        if above:
            ax.text(start + length / 2, COMPUTE_ROW + 0.45, above, ha="center", va="bottom",
                    fontsize=7, color="#444444")  # fmt: skip
    for start, step, color, result in comm_boxes(mode, rounds):
        t = start
        for length, label, c in ((REDUCE_SCATTER, "RS", COLORS["collective"]),
                                 (SHARD_STEP, step, color),
                                 (ALL_GATHER, "AG", COLORS["collective"])):  # fmt: skip
            ax.broken_barh([(t, length * 0.97)], (COMM_ROW - 0.35, 0.7), color=c)
            ax.text(t + length / 2, COMM_ROW, label, ha="center", va="center", fontsize=6.5,
                    color="white" if c == COLORS["Opt"] else "black")  # fmt: skip
            t += length
        ax.text(start + COMM / 2, COMM_ROW - 0.45, result, ha="center", va="top", fontsize=7)
    lanes = ["communication thread\n(RS → shard step → AG)", "main thread\n(forward/backward)"]
    ax.set_yticks([COMM_ROW, COMPUTE_ROW], lanes)
    ax.set_ylim(-1.05, 1.9)
    ax.tick_params(axis="y", length=0)


def main() -> None:
    fig, axes = plt.subplots(3, 1, figsize=(12, 7.6), sharex=True)
    panels = [
        ("ddp", 4, "ddp (synchronous ZeRO-1): the main thread waits while the round communicates"),
        ("dpu", 6, "dpu: round r's communication overlaps round r+1's compute; "
                   "the gradient is one update stale"),
        ("acco", 6, "acco: estimate rounds compute G̃ at the estimate θ̃, update rounds add G "
                    "at θ; one real update per two rounds"),
    ]  # fmt: skip
    for ax, (mode, rounds, title) in zip(axes, panels):
        draw(ax, mode, rounds)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel("time (arbitrary units: one round's compute = 1, its communication = 0.8)")
    legend = [
        Patch(color=COLORS["G"], label="G: micro-batch gradients of a round at θ"),
        Patch(color=COLORS["G̃"], label="G̃: acco's half-batch gradients at the estimate θ̃"),
        Patch(color=COLORS["collective"], label="RS / AG: reduce-scatter / all-gather"),
        Patch(color=COLORS["Opt"], label="Opt: optimizer step of the shard (real update)"),
        Patch(color=COLORS["Peek"], label="Peek: estimate θ̃, optimizer state unchanged"),
        Patch(color=COLORS["wait"], label="idle: waiting for communication"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Schematic (not a measurement): one rank's rounds in ddp, dpu and acco",
                 fontsize=11, x=0.01, ha="left")  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out = pathlib.Path(__file__).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
