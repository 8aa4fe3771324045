"""Built-in tasks: checkers accept the generator's own solutions and reject perturbed ones; determinism."""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

import pytest

from jetrl.data import PromptDataset, resolve_reward
from jetrl.data.tasks import (
    COMPACT_ALPHABET,
    TASKS,
    ArithmeticTask,
    ChainTask,
    CountdownTask,
    check_arithmetic,
    check_chain,
    check_countdown,
    difficulty_for_tokens,
    evaluate_expression,
    get_task,
)
from jetrl.data.tasks.arithmetic import MAX_VALUE

DIFFICULTIES = [1, 2, 3, 5, 8]


def body_and_answer(solution: str) -> tuple[list[str], str]:
    body, final = solution.rsplit("\n#### ", 1)
    return body.split("\n"), final


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_checker_accepts_own_solutions(name, difficulty):
    task = get_task(name, difficulty=difficulty, seed=3)
    for ex in task.examples(150):
        assert resolve_reward(name)(ex.solution, ex.answer) == 1.0, ex
        lines, _ = body_and_answer(ex.solution)
        assert len(lines) == difficulty == ex.difficulty  # one worked step per line
        for line in lines:  # every step is a true equation (the chain task prefixes its step counter, "n>")
            a, op, b, c = re.fullmatch(r"(?:\d+>)?(-?\d+)([-+*/])(\d+)=(-?\d+)", line).groups()
            a, b = Fraction(a), Fraction(b)
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == int(c), line


def test_arithmetic_chain_matches_prompt():
    task = ArithmeticTask(difficulty=6, seed=0)
    for ex in task.examples(100):
        tokens = re.findall(r"[-+*/]\d+|\d+", ex.prompt.strip())
        value = int(tokens[0])
        lines, final = body_and_answer(ex.solution)
        for line, token in zip(lines, tokens[1:], strict=True):
            op, operand = token[0], int(token[1:])
            assert line.startswith(f"{value}{op}{operand}=")
            if op == "/":
                assert value % operand == 0, "division only when exact"
            value = {"+": value + operand, "-": value - operand, "*": value * operand, "/": value // operand}[op]
            assert abs(value) <= MAX_VALUE
        assert final == ex.answer == str(value)


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_arithmetic_rejects_perturbed(difficulty):
    task = ArithmeticTask(difficulty=difficulty, seed=4)
    for ex in task.examples(100):
        lines, final = body_and_answer(ex.solution)
        for wrong in (int(final) + 1, int(final) - 1, -int(final) if int(final) else 7):
            assert not check_arithmetic("\n".join(lines) + f"\n#### {wrong}", ex.answer)
        assert not check_arithmetic(ex.solution + "1", ex.answer)  # a digit too many


def countdown_perturbations(expression: str, numbers: list[int]) -> list[str]:
    """Wrong answers: one number changed, an unavailable number, a number reused, an operator flipped."""
    out = []
    nums = list(re.finditer(r"\d+", expression))
    first = nums[0]
    out.append(expression[: first.start()] + str(int(first.group()) + 1) + expression[first.end():])
    out.append(f"{expression}+{max(numbers) + 100}-{max(numbers) + 100}")  # value kept, number not given
    out.append(f"({expression})*{first.group()}/{first.group()}")  # value kept, a number used twice+
    ops = list(re.finditer(r"[-+*/]", expression))
    if ops:
        flip = {"+": "-", "-": "+", "*": "+", "/": "*"}
        op = ops[-1]
        out.append(expression[: op.start()] + flip[op.group()] + expression[op.end():])
    return out


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_countdown_rejects_perturbed(difficulty):
    task = CountdownTask(difficulty=difficulty, seed=5)
    for ex in task.examples(100):
        lines, expression = body_and_answer(ex.solution)
        numbers = [int(x) for x in ex.answer.split(">")[0].split(",")]
        target = int(ex.answer.split(">")[1])
        for wrong in countdown_perturbations(expression, numbers):
            try:
                value, used = evaluate_expression(wrong)
                valid = value == target and not Counter(used) - Counter(numbers)
            except ValueError:
                valid = False
            if valid:
                continue  # a changed number or operator happened to give another correct answer
            assert not check_countdown("\n".join(lines) + f"\n#### {wrong}", ex.answer), (wrong, ex)


def test_countdown_checker_details():
    ref = "3,5,7,2>24"
    assert check_countdown("#### 5*3+7+2", ref)
    assert check_countdown("some thinking\n#### (7+5)*2*2 \nbye", "3,5,7,2,2>48")  # 2 given twice, used twice
    assert not check_countdown("#### (7+5)*2*2", "3,5,7,2>48")  # 2 given once, used twice
    assert check_countdown("#### 6/(3/4)", "6,3,4>8")  # exact fractions in between are fine
    assert check_countdown("#### (7+5)*2", ref)  # a subset of the numbers is fine
    assert not check_countdown("#### 3*8", ref)  # 8 is not given
    assert not check_countdown("#### 5*5-1", ref)  # 5 twice, 1 not given
    assert not check_countdown("#### -3+27", ref)  # unary minus is not an operation
    assert not check_countdown("#### 24", ref)
    assert not check_countdown("5*3+7+2", ref)  # no answer line
    assert not check_countdown("#### 7/(5-5)", ref)
    assert not check_countdown("#### __import__('os')", ref)
    assert not check_countdown("#### " + "(" * 150 + "3" + ")" * 150, ref)
    assert check_countdown("#### 7*3+(5-2)", ref)
    with pytest.raises(ValueError, match="countdown reference"):
        check_countdown("#### 1", "24")
    for bad in ("3 +", "(3+4", "3 4", "3+*4", "3^2", ""):
        with pytest.raises(ValueError):
            evaluate_expression(bad)
    value, used = evaluate_expression("(12-4)/3*6")
    assert value == 16 and used == [12, 4, 3, 6]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_from_seed(name):
    a = get_task(name, difficulty=(1, 6), seed=42).examples(200)
    b = get_task(name, difficulty=(1, 6), seed=42).examples(200)
    assert a == b
    assert get_task(name, difficulty=(1, 6), seed=42).example(137) == a[137]  # random access, same example
    assert get_task(name, difficulty=(1, 6), seed=43).examples(200) != a
    assert {ex.difficulty for ex in a} == set(range(1, 7))
    assert len({ex.prompt for ex in a}) > 150  # not a handful of repeats


@pytest.mark.parametrize("name", sorted(TASKS))
def test_compact_format_is_small_and_natural_format_explains(name):
    compact = get_task(name, difficulty=4, seed=0)
    for ex in compact.examples(200):
        assert set(ex.prompt + ex.solution) <= set(COMPACT_ALPHABET), ex
        assert ex.prompt.endswith("\n") and len(ex.prompt) < 40
    natural = get_task(name, difficulty=4, seed=0, style="natural")
    for c, n in zip(compact.examples(20), natural.examples(20)):
        assert n.solution == c.solution and n.answer == c.answer and "####" in n.prompt


def test_dataset_and_registry():
    task = get_task("countdown", difficulty=2, seed=1)
    ds = task.dataset(50, start=10)
    assert isinstance(ds, PromptDataset) and len(ds) == 50 and ds.reward == "countdown"
    assert ds[0].index == 10 and (ds[0].text, ds[0].answer) == (task.example(10).prompt, task.example(10).answer)
    assert ds.render(ds[0]) == ds[0].text
    assert resolve_reward(ds.reward)(task.example(10).solution, ds[0].answer) == 1.0
    with pytest.raises(ValueError, match="unknown task 'sudoku'; built-in tasks: arithmetic, chain, countdown"):
        get_task("sudoku")
    with pytest.raises(TypeError, match="task 'arithmetic'"):
        get_task("arithmetic", difficulty=2, max_number=3)
    with pytest.raises(ValueError, match="difficulty must lie in"):
        get_task("countdown", difficulty=0)
    with pytest.raises(ValueError, match="difficulty must lie in"):
        get_task("arithmetic", difficulty=(5, 2))
    with pytest.raises(ValueError, match="style must be"):
        get_task("arithmetic", style="verbose")


# ------------------------------------------------------------------------------ chain (long traces)

def test_chain_trace_follows_the_rule_from_the_prompt():
    task = ChainTask(difficulty=(1, 40), seed=2)
    for ex in task.examples(100):
        start, steps = (int(x) for x in ex.prompt.strip().split(","))
        lines, final = body_and_answer(ex.solution)
        assert steps == ex.difficulty == len(lines)
        value = start
        for counter, line in zip(range(steps, 0, -1), lines, strict=True):
            new = value // 2 if value % 2 == 0 else value + counter  # the rule, written out independently
            assert line == f"{counter}>{value}{'/2' if value % 2 == 0 else f'+{counter}'}={new}"
            value = new
            assert 0 < value < task.max_start + 4 * steps
        assert final == ex.answer == str(value)


def test_chain_length_scales_with_difficulty():
    lengths = {d: sum(len(ex.solution) for ex in ChainTask(d, seed=0).examples(20)) / 20 for d in (10, 100, 1000)}
    assert 8 * 10 < lengths[10] < 20 * 10 and 8 * 100 < lengths[100] < 20 * 100
    assert 8 * 1000 < lengths[1000] < 20 * 1000
    for tokens in (256, 1024, 4096):
        d = difficulty_for_tokens(tokens)
        mean = sum(len(ex.solution) + 1 for ex in ChainTask(d, seed=0).examples(16)) / 16
        assert tokens <= mean < tokens * 1.1, (tokens, d, mean)
    with pytest.raises(ValueError, match="num_tokens"):
        difficulty_for_tokens(0)
    with pytest.raises(ValueError, match="shorter than"):
        difficulty_for_tokens(10**6)


def test_chain_reward_parses_only_the_final_answer_line():
    ex = ChainTask(difficulty=30, seed=1).example(0)
    lines, final = body_and_answer(ex.solution)
    assert check_chain(ex.solution, ex.answer) and check_chain(ex.solution + "\n", ex.answer)
    assert check_chain("junk\n#### 5\n#### " + final, ex.answer)  # the last answer line counts
    for wrong in (int(final) + 1, int(final) - 1, int(final) * 10):
        assert not check_chain("\n".join(lines) + f"\n#### {wrong}", ex.answer)
    assert not check_chain("\n".join(lines), ex.answer)  # a trace without its answer line scores 0
    assert not check_chain("\n".join(lines[:-1]) + f"\n{lines[-1]}", ex.answer)
    assert not check_chain(f"#### {final} and more", ex.answer)
    assert not check_chain(f"#### {final}.0", ex.answer)
    with pytest.raises(ValueError, match="chain reference"):
        check_chain("#### 3", "three")


def test_chain_reward_time_is_bounded_on_pathological_completions():
    import time

    ref = "12345"
    huge = ["#### " + "9" * 1_000_000, "1>2/2=1\n" * 200_000 + "#### " + "1" * 100_000, "#" * 2_000_000,
            "#### 12345" + " " * 1_000_000 + "x"]
    start = time.perf_counter()
    assert not any(check_chain(text, ref) for text in huge)
    assert check_chain("1>2/2=1\n" * 200_000 + "#### 12345", ref)
    assert time.perf_counter() - start < 1.0  # linear scans only: no big-int parsing, no backtracking


def test_chain_options_are_checked():
    with pytest.raises(ValueError, match="max_start"):
        ChainTask(max_start=1)
    with pytest.raises(ValueError, match="difficulty must lie in"):
        ChainTask(difficulty=ChainTask.max_difficulty + 1)
    assert len(ChainTask(difficulty=2048, seed=0).example(3).solution) > 20_000  # several thousand tokens
