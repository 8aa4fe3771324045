"""Imports point one way: quant <- models <- (parallel) <- rollout <- rl, and data <- rl; every top-level
module and package of jetrl has the set of jetrl parts it may import, checked on every import statement
(inside functions too)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jetrl"
# top-level module or package -> what of jetrl it may import: a stage (any module in it) or one dotted module.
# Every part may import itself and the leaf ``progress``.
ALLOWED = {
    "progress": set(),
    "quant": set(),
    "models": {"quant"},
    "parallel": {"quant", "models"},
    "rollout": {"quant", "models", "parallel"},
    "data": set(),
    # the schema checks names against the registries that own them (read on first use); none of these
    # modules imports the config, so there is no loop
    "config": {"jetrl.quant.recipe", "jetrl.rl.advantages", "jetrl.rl.losses", "jetrl.rl.optim"},
    "rl": {"quant", "models", "parallel", "rollout", "data", "config"},
    "evaluate": {"quant", "models", "rollout", "data", "config"},
    "sft": {"quant", "models", "data", "evaluate"},
    "plotting": set(),
    "cli": {"quant", "models", "parallel", "rollout", "data", "config", "rl", "evaluate", "sft", "plotting"},
    "__main__": {"cli"},
}
NOT_CODE = {"__init__.py", "assets", "__pycache__"}


def _jetrl_imports(path: Path) -> set[str]:
    """The dotted jetrl modules that ``path`` imports (``jetrl.x.y``), at any depth of the file."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        modules.update(n for n in names if n.startswith("jetrl.") or n == "jetrl")
    return modules


def _violations(part: str, path: Path) -> list[str]:
    allowed = ALLOWED[part] | {part, "progress"}
    bad = []
    for module in _jetrl_imports(path):
        pieces = module.split(".")
        stage = pieces[1] if len(pieces) > 1 else ""
        if stage not in allowed and not any(module == a or module.startswith(a + ".") for a in allowed):
            bad.append(module)
    return sorted(bad)


def _parts() -> list[str]:
    return sorted(p.stem if p.suffix == ".py" else p.name for p in PACKAGE.iterdir()
                  if p.name not in NOT_CODE and (p.suffix == ".py" or (p / "__init__.py").is_file()))


def test_every_top_level_part_has_an_allowed_set():
    missing = [p for p in _parts() if p not in ALLOWED]
    assert not missing, f"jetrl/{missing} has no entry in ALLOWED: say what it may import"


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_point_one_way(part):
    folder, module = PACKAGE / part, PACKAGE / f"{part}.py"
    if not folder.is_dir() and not module.is_file():
        pytest.skip(f"jetrl/{part} does not exist yet")
    paths = sorted(folder.rglob("*.py")) if folder.is_dir() else [module]
    for path in paths:
        bad = _violations(part, path)
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad} against the data flow"


def test_the_checker_catches_a_wrong_way_import(tmp_path):
    """The check is not vacuous: a data module importing the trainer is reported, a dotted allowance is exact."""
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def f():\n    from jetrl.rl.trainer import Trainer\n")
    assert _violations("data", wrong) == ["jetrl.rl.trainer"]
    assert _violations("config", wrong) == ["jetrl.rl.trainer"]
    fine = tmp_path / "fine.py"
    fine.write_text("import jetrl.progress\nfrom jetrl.rl.losses import KL_ESTIMATORS\n")
    assert _violations("config", fine) == []
