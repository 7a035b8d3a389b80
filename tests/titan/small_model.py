"""The debug model at half its width, ``debugmodel_w128``: the model the torchtitan tests
train on torchtitan 0.2.2.

What those tests hold (ACCO equal to torchtitan's own runs, the layouts composed, resumes,
refusals) does not depend on the model's width; their time on a 2-core CPU does. At dim 128
(the debug model's 6 layers, 16 heads and vocabulary of 2048 kept, so every pipeline split is
the same) a 4-rank HSDP run of 6 steps took 7.7 s against the debug model's 13-14 s.

A job names it with :data:`tests.titan.conftest.SMALL_MODEL`: ``--model.flavor`` and
torchtitan's hook for user code, ``--experimental.custom_import``, which imports this module
on every rank before the model is built, forked or launched by torchrun alike.

torchtitan 0.3.0 builds its models from config functions whose widths are locals: its runs
train the debug model as it ships, and importing this module there registers nothing.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models import llama3

FLAVOR = "debugmodel_w128"

_flavors = getattr(llama3, "llama3_args", None)  # 0.2.2's registry
if _flavors is not None:
    _flavors.setdefault(FLAVOR, dataclasses.replace(_flavors["debugmodel"], dim=128))
