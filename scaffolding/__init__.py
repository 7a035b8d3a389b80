"""What the project's main job, examples, tests and benchmarks need beyond the library; not
part of the installed package.

- ``cpu_shim``: torchtitan (0.2.2 or 0.3.0) on a machine without an accelerator, over gloo;
- ``stdlib_data``: the embedded data, the Python standard library's own source, as bytes for
  the plain-loop examples and as a JSONL dataset with its BPE tokenizer for torchtitan and the
  Hugging Face example;
- ``process_exit``: how every process of the checkout that ran on process groups ends, so that
  none aborts at interpreter exit after a successful run.

Run what uses it from the checkout's root (``python -m examples.X``, ``train_titan.py``).
"""
