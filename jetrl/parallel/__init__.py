"""Several GPUs: device mesh and ranks, FSDP2 sharding, full weights for rollout, DCP checkpoints.

Sits between ``models`` and ``rollout`` in the import order (``quant <- models <- parallel <- rollout <-
rl``). One process is the degenerate case of every function here (one rank, no mesh), so callers need no
``if distributed`` branches."""

from jetrl.parallel.checkpoint import SHARDED_SUBDIR, load_sharded, save_sharded
from jetrl.parallel.fsdp import (FORWARD_METHODS, fsdp_modules, full_weights, is_sharded, refresh_rollout_weights,
                                 shard_model)
from jetrl.parallel.mesh import ParallelContext, init_parallel, launched_by_torchrun, launched_rank

__all__ = ["ParallelContext", "init_parallel", "launched_by_torchrun", "launched_rank", "shard_model", "full_weights",
           "fsdp_modules", "is_sharded", "refresh_rollout_weights", "FORWARD_METHODS", "save_sharded", "load_sharded",
           "SHARDED_SUBDIR"]
