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


# ------------------------------------------------------------------------------ quant/kernels (issue 14)


def _module_level_imports(path: Path) -> set[str]:
    """Full names imported by the module's top-level statements (not inside functions or classes)."""
    names = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_quant_kernels_import_triton_at_module_level():
    """Triton stays lazy everywhere but in jetrl/quant/kernels (which the seam imports lazily)."""
    kernels = PACKAGE / "quant" / "kernels"
    for path in PACKAGE.rglob("*.py"):
        if kernels in path.parents:
            continue
        heavy = {n for n in _module_level_imports(path) if n.split(".")[0] == "triton"}
        assert not heavy, f"{path.relative_to(PACKAGE.parent)} imports {sorted(heavy)} at module level"


def test_kernels_import_only_quant_and_nothing_imports_them_at_module_level():
    kernels = PACKAGE / "quant" / "kernels"
    for path in kernels.rglob("*.py"):
        bad = {n for n in _module_level_imports(path) if n.startswith("jetrl.") and not n.startswith("jetrl.quant")}
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)}: kernels import only jetrl.quant"
    for path in PACKAGE.rglob("*.py"):
        if kernels in path.parents:
            continue
        eager = {n for n in _module_level_imports(path) if n.startswith("jetrl.quant.kernels")}
        assert not eager, f"{path.relative_to(PACKAGE.parent)} imports {sorted(eager)} at module level"


def test_quant_modules_import_no_loop():
    """No import cycle among jetrl.quant's modules, counting imports inside functions too."""
    quant = PACKAGE / "quant"
    name_of = {p: "jetrl." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in quant.rglob("*.py")}
    name_of = {p: n[: -len(".__init__")] if n.endswith(".__init__") else n for p, n in name_of.items()}
    modules = set(name_of.values())
    edges = {}
    for path, name in name_of.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        edges[name] = {m for m in found if m in modules and m != name and m != "jetrl.quant"}
    state: dict[str, int] = {}

    def visit(module: str, chain: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            assert state.get(nxt) != 1, f"import loop: {' -> '.join(chain + [module, nxt])}"
            if nxt not in state:
                visit(nxt, chain + [module])
        state[module] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [])
