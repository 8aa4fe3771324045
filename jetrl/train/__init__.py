"""The training stage under ``rl`` and ``sft``: what both train with.

* :mod:`jetrl.train.checkpoint`: atomic, checksummed, pickle-free checkpoint folders (write, verify, list,
  prune, load);
* :mod:`jetrl.train.optim`: AdamW on fp32 master weights (and the release of the BF16 copies the FP8 linears do
  not read), clipping, the LR schedules, the non-finite guard.

It imports quant and config, never the stages above it (``rl``, ``sft``).
"""
