"""Draw docs/figures/hsdp_mesh.png: FSDP2 inside each node, ACCO across nodes.

    pip install -e ".[docs]" && python docs/figures/hsdp_mesh.py
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

NODES, GPUS = 3, 4  # replicas (dp_replicate) x FSDP shards per replica (dp_shard)
SHARD_COLORS = ["#264653", "#2a9d8f", "#e9c46a", "#f4a261"]


def main() -> None:
    fig, ax = plt.subplots(figsize=(10, 5.2))
    for node in range(NODES):
        x0 = node * 3.4
        ax.add_patch(FancyBboxPatch((x0, 0), 3.0, 4.6, boxstyle="round,pad=0.05",
                                    facecolor="#f5f5f5", edgecolor="#888888"))  # fmt: skip
        ax.text(x0 + 1.5, 4.85, f"node {node} = replica {node}", ha="center", fontsize=11)
        for gpu in range(GPUS):
            y = 3.7 - gpu * 1.05
            ax.add_patch(FancyBboxPatch((x0 + 0.35, y), 2.3, 0.7, boxstyle="round,pad=0.02",
                                        facecolor=SHARD_COLORS[gpu], edgecolor="none"))  # fmt: skip
            rank = node * GPUS + gpu
            ax.text(x0 + 1.5, y + 0.35, f"rank {rank}: FSDP shard {gpu} (1/{GPUS})",
                    ha="center", va="center", color="white", fontsize=8)  # fmt: skip
        # the intra-node FSDP dimension: all-gather in forward, reduce-scatter once per round
        ax.annotate("", xy=(x0 + 0.18, 0.4), xytext=(x0 + 0.18, 4.3),
                    arrowprops=dict(arrowstyle="<->", color="#555555", lw=1.5))  # fmt: skip
        ax.text(x0 + 0.1, 2.35, "fsdp (NVLink)", rotation=90, va="center", ha="right",
                fontsize=8, color="#555555", backgroundcolor="#f5f5f5")  # fmt: skip
    for gpu in range(GPUS):  # one ACCO group per shard index, across the nodes
        y = 3.7 - gpu * 1.05 + 0.35
        for node in range(NODES - 1):
            ax.plot([node * 3.4 + 2.7, node * 3.4 + 3.7], [y, y], color="#d62828", lw=2.5,
                    ls="--", zorder=3)  # fmt: skip
    ax.text(3.4 * NODES / 2 - 0.2, -0.55,
            "dashed: dp_replicate groups (slow inter-node links). On each, the ACCO engine "
            "reduce-scatters the\nnode-summed gradient of one FSDP shard, steps a 1/(S·R) fp32 "
            "master shard and all-gathers it,\nwhile the next round computes. Optimizer state: "
            "sharded S·R ways.",
            ha="center", va="top", fontsize=9)  # fmt: skip
    ax.set_xlim(-0.6, 3.4 * NODES)
    ax.set_ylim(-1.8, 5.2)
    ax.axis("off")
    out = pathlib.Path(__file__).with_suffix(".png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
