"""Convergence and heterogeneous-hardware benchmarks of ACCO, DPU and DDP on torchtitan (CPU).

``run.py`` runs the experiments and writes a JSON file, ``plot.py`` draws and tabulates it,
``slow_rank.py`` is the module imported by each torchtitan rank to slow rank 1 down and to
count micro-batches per rank.
"""
