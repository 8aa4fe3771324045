"""Reward functions that misbehave on purpose, importable by the reward pool's worker processes."""

import os
import time


def misbehaving(completion_text: str, reference_answer: str) -> float:
    """Exact-match reward, except: "hang" sleeps forever, "raise" raises, "crash" kills the process,
    "nan" returns NaN, "text" returns the string "1", "slow" takes 0.3 s and then answers normally."""
    if completion_text == "hang":
        while True:
            time.sleep(3600)
    if completion_text == "raise":
        raise RuntimeError("reward function exploded")
    if completion_text == "crash":
        os._exit(7)
    if completion_text == "nan":
        return float("nan")
    if completion_text == "text":
        return "1"  # type: ignore[return-value]
    if completion_text == "slow":
        time.sleep(0.3)
        return 0.5
    return 1.0 if completion_text == reference_answer else 0.0



class BrokenWarmup:
    """A reward whose start-up fails in the worker (as a missing dependency would)."""

    def warmup(self) -> None:
        raise ImportError("this reward needs a package that is not installed")

    def __call__(self, completion_text: str, reference_answer: str) -> float:
        return 0.0


def scaled(completion_text: str, reference_answer: str) -> float:
    """The completion read as a number (a reward of any magnitude); float() of a non-number raises."""
    return float(completion_text)


def fails_late_first(completion_text: str, reference_answer: str) -> float:
    """Raises for every sample, after sleeping the number of milliseconds the completion names: samples given
    shorter sleeps fail first, whatever their position."""
    time.sleep(int(completion_text) / 1000)
    raise ValueError(f"no reward for {completion_text}")
