"""Runnable training scripts. Run them from the checkout's root as modules (``python -m
torch.distributed.run ... -m examples.<name>``): they read the embedded data from
``scaffolding/``, which is not part of the installed library."""
