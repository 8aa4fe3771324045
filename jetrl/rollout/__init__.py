"""Rollout: batched generation on the policy model through a paged KV cache (continuous batching,
prefix sharing of the n samples of a prompt, preemption by recomputation, CUDA-graph decode).

``engine`` (the generate loop: requests, steps, stats) drives ``scheduler`` (which tokens each step
computes; ``block_manager`` hands out KV blocks; ``sequence`` is one sample's state) and ``model_runner``
(everything on the device: KV cache, CUDA graphs, step inputs, and the ``sampling`` of the logits, whose
log-probabilities are the trainer's definition).
"""

from jetrl.rollout.block_manager import BlockManager, NoFreeBlocks
from jetrl.rollout.engine import RolloutEngine
from jetrl.rollout.model_runner import LaunchedStep, ModelRunner
from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample, seeded_uniform
from jetrl.rollout.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from jetrl.rollout.sequence import Completion, Sequence, SequenceStatus

__all__ = ["RolloutEngine", "ModelRunner", "LaunchedStep", "SamplingParams", "SamplingBatch", "sample",
           "seeded_uniform", "Completion", "Sequence", "SequenceStatus", "BlockManager", "NoFreeBlocks", "Scheduler",
           "SchedulerOutput", "ScheduledChunk"]
