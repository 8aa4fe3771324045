"""Rollout: batched generation on the policy model through a paged KV cache (continuous batching,
prefix sharing of the n samples of a prompt, preemption by recomputation, CUDA-graph decode).

Log-probabilities are ``log_softmax(logits / T)`` in fp32 before top-k/top-p truncation, the trainer's
definition (see :mod:`jetrl.rollout.sampling`).
"""

from jetrl.rollout.block_manager import BlockManager, NoFreeBlocks
from jetrl.rollout.engine import RolloutEngine
from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample, seeded_uniform
from jetrl.rollout.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from jetrl.rollout.sequence import Completion, Sequence, SequenceStatus

__all__ = ["RolloutEngine", "SamplingParams", "SamplingBatch", "sample", "seeded_uniform", "Completion",
           "Sequence", "SequenceStatus", "BlockManager", "NoFreeBlocks", "Scheduler", "SchedulerOutput",
           "ScheduledChunk"]
