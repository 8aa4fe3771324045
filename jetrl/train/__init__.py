"""The training stage under ``rl`` and ``sft``: what both train with.

* :mod:`jetrl.train.checkpoint`: atomic, checksummed, pickle-free checkpoint folders (write, verify, list,
  prune, load);
* :mod:`jetrl.train.optim`: AdamW on fp32 master weights (and the release of the BF16 copies the FP8 linears do
  not read), clipping, the LR schedules, the non-finite guard;
* :mod:`jetrl.train.policy`: a run's checkpoint policy: which checkpoints it writes and keeps, whether one fits
  on the disk, which one it resumes from, and whether a fresh run may write into an output folder.

It imports quant, models, parallel and config, never the stages above it (``rl``, ``sft``).
"""
