"""Imports point one way: quant <- models <- rollout <- rl, and data <- rl."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jetrl"
# stage -> jetrl stages it may import
ALLOWED = {
    "quant": {"quant"},
    "models": {"quant", "models"},
    "rollout": {"quant", "models", "rollout"},
    "data": {"data"},
    "rl": {"quant", "models", "rollout", "data", "rl", "config"},
}
# several GPUs: parallel sits between models and rollout (quant <- models <- parallel <- rollout <- rl)
ALLOWED["parallel"] = {"quant", "models", "parallel"}
for _stage in ("rollout", "rl"):
    ALLOWED[_stage] = ALLOWED[_stage] | {"parallel"}


def _jetrl_imports(path: Path) -> set[str]:
    stages = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "jetrl" and len(parts) > 1:
                stages.add(parts[1])
    return stages


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_stage_imports_point_one_way(stage):
    folder = PACKAGE / stage
    if not folder.exists():
        pytest.skip(f"jetrl/{stage} does not exist yet")
    for path in folder.rglob("*.py"):
        bad = _jetrl_imports(path) - ALLOWED[stage]
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports jetrl.{sorted(bad)} against the data flow"
