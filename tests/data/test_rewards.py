"""GSM8K numeric matching and MATH equivalence (math-verify) on the real test sets, plus hand cases."""

from __future__ import annotations

import pickle
from fractions import Fraction

import pytest

from jetrl.data import RewardConfig, RewardPool, RewardPoolConfig, build_reward_fn, gsm8k_reward, math_reward
from jetrl.data.answers import extract_final_number
from jetrl.data.rewards import resolve_reward


def gsm8k_final(answer: str) -> Fraction:
    return Fraction(answer.split("####")[-1].strip().replace(",", ""))


def test_every_gsm8k_answer_matches_itself_and_not_another(gsm8k_test_rows):
    answers = [r["answer"] for r in gsm8k_test_rows]
    assert len(answers) == 1319
    for i, answer in enumerate(answers):
        assert gsm8k_reward(answer, answer) == 1.0, answer
        n = gsm8k_final(answer)
        # The same final number as a model might write it: boxed, "the answer is", $ and commas, .00 and units.
        text = f"{int(n):,}" if n.denominator == 1 else str(float(n))
        for completion in (f"So the total is \\boxed{{{text}}}.", f"Thus the answer is ${text}.",
                           f"We get {text}.00 dollars in the end", f"#### {text}"):
            assert gsm8k_reward(completion, answer) == 1.0, (completion, answer)
        # Another problem's answer, the next one with a different final number.
        other = next(answers[k % 1319] for k in range(i + 1, i + 1319) if gsm8k_final(answers[k % 1319]) != n)
        assert gsm8k_reward(other, answer) == 0.0, (other, answer)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("6 + 12 = 18 so she makes $18 every day.\n#### 18", 18),
        ("The answer is: 1,000,000 people", 1_000_000),
        ("#### $1,250.00", 1250),
        ("Final answer: -7 degrees", -7),
        ("the temperature is \u22127", -7),  # Unicode minus
        ("It costs 3.50 dollars; the answer is 3.5.", Fraction(7, 2)),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{-\\dfrac{1}{2}}", Fraction(-1, 2)),
        ("\\boxed{45\\%}", 45),
        ("15 - 8 = 7 and 7 * 2 = 14 pens", 14),
        ("10-3", 3),  # a minus between numbers is subtraction, not a sign
        ("The answer is 12. Then I double-check: 6 + 6 = 12", 12),
        ("#### 42\nThe answer is 7", 42),  # '####' wins over later text
        ("#### 3/5", Fraction(3, 5)),  # a slash fraction is one number, not its numerator
        ("so 1/4 of them", Fraction(1, 4)),  # nor its denominator
        ("60/2 = 30 apples", 30),
        ("\\boxed{72 \\text{ cm}^2}", 72),  # a unit and its exponent are not the answer
        ("\\boxed{2\\frac{1}{2}}", Fraction(5, 2)),  # a mixed number
        ("\\boxed{1.5 \\times 10^{3}}", 1500),
        ("#### 1/0", None),
        ("no digits here", None),
        ("", None),
    ],
)
def test_final_number_extraction(completion, expected):
    assert extract_final_number(completion) == (None if expected is None else Fraction(expected))


def test_gsm8k_reward_cases():
    ref = "Janet sells 16 - 3 - 4 = 9 eggs at $2: 9 * 2 = 18\n#### 18"
    assert gsm8k_reward("She makes 18.0 dollars.", ref) == 1.0
    assert gsm8k_reward("She makes 18.5 dollars.", ref) == 0.0
    assert gsm8k_reward("#### -18", ref) == 0.0
    assert gsm8k_reward("I don't know", ref) == 0.0
    assert gsm8k_reward("#### 1,800", "#### 1800") == 1.0
    assert gsm8k_reward("-5", "#### -5") == 1.0 and gsm8k_reward("5", "#### -5") == 0.0
    assert gsm8k_reward("The answer is 42", "42") == 1.0  # a bare-number reference
    assert gsm8k_reward("#### 3/4", "#### 3") == 0.0 and gsm8k_reward("#### 3/5", "#### 3/4") == 0.0
    assert gsm8k_reward("#### 6/2", "#### 3") == 1.0
    with pytest.raises(ValueError, match="states no number"):
        gsm8k_reward("#### 3", "#### none")


# (completion's answer, reference) pairs math-verify must judge equal.
EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac12", "\\frac{1}{2}"),
    ("\\tfrac{1}{2}", "0.5"),
    ("1/2", "\\frac12"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("(1, 2]", "(1,2]"),
    ("[0,\\infty)", "x \\in [0, \\infty)"),
    ("\\{2, 1\\}", "\\{1,2\\}"),
    ("3, 2", "2,3"),
    ("1000", "1,000"),
    ("3", "3.0"),
    ("5", "x=5"),
    ("90", "90^\\circ"),
    ("\\$5", "5"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("6-5i", "6 - 5i"),
    ("\\text{(C)}", "C"),
]
# Near misses that must not match.
DIFFERENT = [
    ("\\frac{1}{3}", "\\frac{1}{2}"),
    ("0.333", "\\frac{1}{3}"),
    ("[1,2]", "(1,2]"),
    ("(1,2)", "(1,2]"),
    ("\\sqrt{3}", "\\sqrt{2}"),
    ("2\\sqrt{2}", "\\sqrt{2}"),
    ("-\\frac{1}{2}", "\\frac{1}{2}"),
    ("\\frac{\\pi}{3}", "\\frac{\\pi}{2}"),
    ("\\{1, 3\\}", "\\{1,2\\}"),
    ("6+5i", "6-5i"),
    ("100", "1000"),
]


@pytest.mark.parametrize("written,reference", EQUIVALENT)
def test_math_equivalent_rewrites(written, reference):
    assert math_reward(f"Therefore the answer is $\\boxed{{{written}}}$.", reference) == 1.0


@pytest.mark.parametrize("written,reference", DIFFERENT)
def test_math_near_misses(written, reference):
    assert math_reward(f"Therefore the answer is $\\boxed{{{written}}}$.", reference) == 0.0


def test_math_reward_without_box_and_without_answer():
    assert math_reward("So $x = \\frac{14}{3}$.", "\\frac{14}{3}") == 1.0  # last expression, no box
    assert math_reward("I cannot solve this.", "\\frac{14}{3}") == 0.0
    assert math_reward("", "7") == 0.0


def test_every_math500_answer_matches_itself_and_not_another(math500_rows):
    answers = [r["answer"] for r in math500_rows]
    assert len(answers) == 500

    def distinct(a: str, b: str) -> bool:
        # '5' and 'x=5' are the same answer to math-verify (and to a grader): not a negative pair.
        strip = lambda s: s.split("=")[-1].replace(" ", "")  # noqa: E731
        return strip(a) != strip(b)

    partners = [next(answers[k % 500] for k in range(i + 1, i + 500) if distinct(answers[k % 500], a))
                for i, a in enumerate(answers)]
    own = [f"Hence the final answer is $\\boxed{{{a}}}$." for a in answers]
    other = [f"$\\boxed{{{p}}}$" for p in partners]
    # 1,000 math-verify calls (the cross-problem ones are slow: sympy compares unequal expressions the
    # long way) run in the reward pool on both cores; the generous timeout is for a loaded machine.
    with RewardPool("math", RewardPoolConfig(num_workers=2, timeout_s=30.0)) as pool:
        result = pool.score(own + other, answers + answers)
    assert result.num_failed == 0, result.errors
    assert [a for a, r in zip(answers, result.rewards[:500]) if r != 1.0] == []
    assert [(p, a) for p, a, r in zip(partners, answers, result.rewards[500:]) if r != 0.0] == []


def test_reward_config():
    plain = build_reward_fn(RewardConfig(), default="math")
    assert plain("$\\boxed{2}$", "2") == 1.0 and pickle.loads(pickle.dumps(plain))("$\\boxed{3}$", "2") == 0.0
    with pytest.raises(ValueError, match="no reward function"):
        build_reward_fn(RewardConfig())


def test_resolve_reward_names_and_errors():
    assert resolve_reward("gsm8k") is gsm8k_reward and resolve_reward("math") is math_reward
    assert resolve_reward("jetrl.data.rewards:gsm8k_reward") is gsm8k_reward
    assert resolve_reward("jetrl.data.rewards.math_reward") is math_reward
    assert resolve_reward("countdown")("#### 3*4", "3,4>12") == 1.0
    assert resolve_reward("arithmetic")("#### 12", "12") == 1.0
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_reward("gsm9k")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_reward("no_such_module:fn")
    with pytest.raises(ValueError, match=r"has no attribute 'gsm8k_rewrd'.*gsm8k_reward"):
        resolve_reward("jetrl.data.rewards:gsm8k_rewrd")
    with pytest.raises(TypeError, match="not callable"):
        resolve_reward("jetrl.data.rewards:BUILTIN_REWARDS")


# ---------------------------------------------------------------- pathological completions: bounded work

HUGE = "#### " + "9" * 1_000_000  # 143 s in the GSM8K reward before the cap (number conversion in C)


@pytest.fixture
def converted(monkeypatch):
    """Records the length of every string the answer parser converts to a number."""
    import jetrl.data.answers as answers

    seen: list[int] = []
    real = answers.Decimal

    def recording(text):
        seen.append(len(text))
        return real(text)

    monkeypatch.setattr(answers, "Decimal", recording)
    return seen


def test_a_million_digit_answer_is_not_converted(converted):
    from jetrl.data.answers import MAX_NUMBER_CHARS
    from jetrl.data.tasks.arithmetic import arithmetic_reward
    from jetrl.data.tasks.countdown import countdown_reward

    assert gsm8k_reward(HUGE, "#### 9") == 0.0
    assert arithmetic_reward(HUGE, "9") == 0.0
    assert countdown_reward(HUGE, "3,5,7,2>24") == 0.0
    assert extract_final_number("x " * 100_000 + "\\boxed{" + "1" * 1_000_000 + "}") is None
    assert converted and max(converted) <= MAX_NUMBER_CHARS
    # a long but sane answer still counts
    assert gsm8k_reward("#### 1,234,567,890,123.50", "#### 1234567890123.5") == 1.0


def test_math_reward_hands_math_verify_a_bounded_excerpt(monkeypatch):
    pytest.importorskip("math_verify")
    import math_verify

    from jetrl.data.rewards import MATH_ANSWER_CHARS

    seen: list[int] = []
    real = math_verify.parse

    def recording(text, *args, **kwargs):
        seen.append(len(text))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(math_verify, "parse", recording)
    assert math_reward("blah " * 200_000 + "so \\boxed{\\frac{1}{2}} and " + "x" * 1_000_000, "0.5") == 1.0
    assert math_reward("9" * 1_000_000, "5") == 0.0
    assert seen and max(seen) <= MATH_ANSWER_CHARS
