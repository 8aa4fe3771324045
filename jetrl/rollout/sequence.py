"""One sample being generated: its tokens, how many of them are in the KV cache, and its outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from jetrl.rollout.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not in the cache (new, or preempted: its cache will be recomputed)
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class Completion:
    """One finished sample: the generated token ids, their log-probabilities, and why it ended.

    ``logprobs[i]`` is ``log_softmax(logits / T)[token_ids[i]]`` in fp32 before top-k/top-p truncation
    (see :mod:`jetrl.rollout.sampling`). ``finish_reason`` is ``"stop"`` (a stop token, stop string or
    end-of-sequence id, kept as the last token) or ``"length"`` (``max_tokens`` or the context limit).
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    sample_index: int = 0


class Sequence:
    """Token state of one sample. ``block_table`` lists the physical KV blocks holding its first
    ``num_computed_tokens`` tokens (the newest sampled token is not in the cache until the next step)."""

    def __init__(self, seq_id: int, prompt_index: int, sample_index: int, prompt_ids: list[int],
                 params: SamplingParams, stop_ids: frozenset[int]) -> None:
        self.seq_id = seq_id
        self.prompt_index = prompt_index
        self.sample_index = sample_index
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.stop_ids = stop_ids
        self.logprobs: list[float] = []
        self.block_table: list[int] = []
        # bumped whenever block_table changes other than by an append (so copies can update incrementally)
        self.table_version = 0
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token: int, logprob: float) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)

    def to_completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(prompt_index=self.prompt_index, token_ids=self.output_ids, logprobs=list(self.logprobs),
                          finish_reason=self.finish_reason, sample_index=self.sample_index)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, prompt={self.prompt_index}/{self.sample_index}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")


__all__ = ["Completion", "Sequence", "SequenceStatus"]
