"""The training stage under ``rl`` and ``sft``: what both train with.

* :mod:`jetrl.train.checkpoint`: atomic, checksummed, pickle-free checkpoint folders;
* :mod:`jetrl.train.optim`: AdamW on fp32 master weights, clipping, the LR schedules, the non-finite guard;
* :mod:`jetrl.train.policy`: a run's checkpoint policy (which checkpoints, disk space, resume, output folder).

It imports quant, models, parallel and config, never the stages above it (``rl``, ``sft``).
"""
