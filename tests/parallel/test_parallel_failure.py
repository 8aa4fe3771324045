"""A rank that fails brings the job down with its message, instead of hanging the others."""

import logging
import time

from launch import run_ranks
from toy_run import low_token_reward, make_trainer


def _step_with_a_crashing_reward(rank):
    from jetrl.parallel import init_parallel

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("jetrl.parallel").addHandler(handler)
    parallel = init_parallel("cpu", timeout_s=60)

    def reward(texts, references):
        if parallel.rank == 1:
            raise ValueError("the reward function crashed on purpose")
        return low_token_reward(texts, references)

    trainer = make_trainer("bf16", (), parallel, reward_fn=reward)
    try:
        with parallel.guard():
            trainer.step()
    except Exception as exc:  # each rank reports how it ended; the test checks that both did end
        return f"{type(exc).__name__}: {exc}", logged
    return None, logged


def test_failing_rank_stops_every_rank_with_its_message():
    start = time.perf_counter()
    ended = run_ranks(_step_with_a_crashing_reward, 2, timeout_s=100)
    # rank 0 was waiting in a collective for rank 1's rewards: the abort ends it well before the 60 s timeout
    assert time.perf_counter() - start < 50
    assert ended[1][0] == "ValueError: the reward function crashed on purpose"
    assert "rank 1/2 failed: ValueError: the reward function crashed on purpose" in ended[1][1]
    assert ended[0][0] is not None  # its collective failed instead of hanging
    assert ended[0][1] and ended[0][1][0].startswith("rank 0/2 failed")
