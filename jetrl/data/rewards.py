"""Reward functions: ``fn(completion_text, reference_answer) -> float``.

Built in:

* :func:`gsm8k_reward` -- 1.0 when the completion's final number equals the reference's (GSM8K's full
  ``answer`` text ending in ``#### N``, or a bare number), compared as exact fractions after normalising
  thousands separators, ``$``, units, trailing ``.0`` and minus signs (see :mod:`jetrl.data.answers`).
* :func:`math_reward` -- 1.0 when ``math-verify`` finds the completion's answer (``\\boxed{}`` first, else
  the last expression) mathematically equal to the reference (MATH's ``answer`` field): fractions,
  radicals, intervals, sets, LaTeX spellings (``\\dfrac12`` = ``\\frac{1}{2}`` = ``0.5``). It parses at most
  :data:`MATH_ANSWER_CHARS` characters of the completion (:func:`answer_excerpt`), so a pathological
  completion costs bounded time and math-verify's own timeout warnings (which quote their input) stay short.
* the built-in tasks' checkers, by task name (``"arithmetic"``, ``"countdown"``, ``"chain"``).

Any other callable with the same signature plugs in by name: :func:`resolve_reward` accepts a built-in
name or a dotted path ``"package.module:function"``. Reward functions must be importable at module level so
that worker processes (:mod:`jetrl.data.reward_pool`) can load them; everything here is picklable for that
reason.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from jetrl.data.answers import extract_final_number, reference_number

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, str] = {
    "gsm8k": "jetrl.data.rewards:gsm8k_reward",
    "math": "jetrl.data.rewards:math_reward",
    "arithmetic": "jetrl.data.tasks.arithmetic:arithmetic_reward",
    "countdown": "jetrl.data.tasks.countdown:countdown_reward",
    "chain": "jetrl.data.tasks.chain:chain_reward",
}


def gsm8k_reward(completion_text: str, reference_answer: str) -> float:
    """1.0 if the completion's final number equals the reference's, else 0.0 (no number: 0.0).
    Raises ValueError when the reference itself states no number (a data error, not a wrong answer)."""
    expected = reference_number(reference_answer)  # first: a reference without a number raises
    return 1.0 if extract_final_number(completion_text) == expected else 0.0  # None (no number) equals no Fraction


MATH_ANSWER_CHARS = 1000  # what math_reward hands to math-verify: a final answer is short


def answer_excerpt(text: str, limit: int = MATH_ANSWER_CHARS) -> str:
    """The part of a completion that holds its final answer, at most ``limit`` characters: from the last
    ``\\boxed`` (or ``\\fbox``) on when there is one, else the end of the text."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    return text[start : start + limit] if start >= 0 else text[-limit:]


def _math_timeout() -> int | None:
    """math-verify enforces its timeouts with SIGALRM, which only the main thread may use; elsewhere run
    without (the reward pool's per-sample timeout still bounds the time)."""
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference_answer: str) -> tuple:
    from math_verify import parse

    text = reference_answer.strip()
    if "\\boxed" not in text:
        text = "\\boxed{" + text + "}"
    parsed = parse(text, parsing_timeout=_math_timeout())
    if not parsed:
        raise ValueError(f"math-verify could not parse the reference answer {reference_answer!r}")
    return tuple(parsed)


def math_reward(completion_text: str, reference_answer: str) -> float:
    """1.0 if math-verify judges the completion's answer equal to the reference, else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("math_reward needs the math-verify package: pip install math-verify") from None
    gold = list(_parse_reference(reference_answer))
    timeout = _math_timeout()
    predicted = parse(answer_excerpt(completion_text), parsing_timeout=timeout)
    return 1.0 if predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0


# called by reward workers at start-up: imports math-verify and sympy and runs one check, so that a fresh worker's
# first sample is not slow
math_reward.warmup = functools.partial(math_reward, "\\boxed{\\frac{1}{2}}", "0.5")


def warm_up(fn: RewardFn) -> None:
    """Run ``fn.warmup()`` if the reward function has one (heavy imports, caches)."""
    hook = getattr(fn, "warmup", None)
    if callable(hook):
        hook()


@functools.lru_cache(maxsize=256)
def _import_callable(spec: str) -> Callable:
    module_name, sep, attr_path = spec.partition(":")
    if not sep:  # "pkg.mod.fn"
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"reward {spec!r} is neither a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) nor a "
                         "dotted path like 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ValueError(f"reward {spec!r}: {getattr(obj, '__name__', obj)!r} has no attribute {part!r}; "
                             f"its callables: {', '.join(public[:30])}{' ...' if len(public) > 30 else ''}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward {spec!r} resolved to a {type(obj).__name__}, which is not callable")
    return obj


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """A reward function from a built-in name (``"gsm8k"``, ``"math"``, ``"arithmetic"``,
    ``"countdown"``, ``"chain"``), a dotted path (``"mypkg.rewards:score"`` or ``"mypkg.rewards.score"``), or a
    callable (returned as is)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"a reward must be a name, a dotted path or a callable, got {spec!r}")
    return _import_callable(BUILTIN_REWARDS.get(spec, spec))


@dataclass
class RewardConfig:
    """Which reward to compute: ``name`` is a built-in name or ``"package.module:function"`` (None: the
    dataset's default)."""

    name: str | None = None


def build_reward_fn(config: RewardConfig, default: str | None = None) -> RewardFn:
    """The picklable reward callable ``config`` describes (``default``: the dataset's reward name).
    Resolves the name now, so a typo fails at start-up rather than in a worker."""
    name = config.name or default
    if name is None:
        raise ValueError("no reward function: set data.reward (e.g. 'gsm8k', 'math' or 'package.module:function')")
    resolve_reward(name)
    return _NamedReward(name)


@dataclass(frozen=True)
class _NamedReward:
    """A reward held by name: pickles as a short string, resolves on first use in each process."""

    name: str

    def warmup(self) -> None:
        warm_up(resolve_reward(self.name))

    def __call__(self, completion_text: str, reference_answer: str) -> float:
        return float(resolve_reward(self.name)(completion_text, reference_answer))
