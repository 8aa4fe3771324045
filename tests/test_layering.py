"""Imports point one way: quant <- models <- (parallel) <- rollout <- rl, (parallel) <- train <- rl and sft, and
data <- rl; every top-level module and package of jetrl has the set of jetrl parts it may import, checked on every
import statement (inside functions too)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jetrl"
# top-level module or package -> what of jetrl it may import: a stage (any module in it) or one dotted module.
# Every part may import itself and the leaves ``progress`` and ``threads``.
ALLOWED = {
    "progress": set(),
    "threads": set(),
    "quant": set(),
    "models": {"quant"},
    "parallel": {"quant", "models"},
    "rollout": {"quant", "models", "parallel"},
    "data": set(),
    # the schema checks recipes against the quant registry (read on first use) and kernel settings against the
    # tuning object; the RL stage's choice names live in the config itself (jetrl.config.choices)
    "config": {"jetrl.quant.recipe", "jetrl.quant.kernels.tuning"},
    # the training stage under rl and sft: checkpoint files and policy, the master-weight optimizer
    "train": {"quant", "models", "parallel", "config"},
    "rl": {"quant", "models", "parallel", "rollout", "data", "config", "train"},
    "evaluate": {"quant", "models", "rollout", "data", "config"},
    # sft checkpoints through the training stage's atomic, checksummed checkpoint files and trains BF16 with its
    # master-weight AdamW
    "sft": {"quant", "models", "data", "evaluate", "train"},
    "plotting": set(),
    "asset_files": set(),
    "bench_scripts": set(),
    "tables": set(),
    # an RL run with its held-out check and plot (the RL loop plus what rl itself may not import), and the checks
    # jetrl train makes before a model loads
    "train_job": {"config", "evaluate", "plotting", "jetrl.rl.loop", "train", "registries", "models", "data",
                  "asset_files"},
    # every registry a config field names, for the configuration reference and `jetrl config check`
    "registries": {"config", "quant", "data", "rl", "train"},
    "cli": {"quant", "models", "parallel", "rollout", "data", "config", "rl", "evaluate", "sft", "plotting",
            "asset_files", "bench_scripts", "tables", "train_job", "registries"},
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
    allowed = ALLOWED[part] | {part, "progress", "threads"}
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
    fine.write_text("import jetrl.progress\nfrom jetrl.quant.recipe import RECIPES\n")
    assert _violations("config", fine) == []
    up = tmp_path / "up.py"  # the config reads no registry of the RL stage above it
    up.write_text("def f():\n    from jetrl.rl.losses import KL_ESTIMATORS\n")
    assert _violations("config", up) == ["jetrl.rl.losses"]


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


def _import_graph() -> dict[str, set[str]]:
    """jetrl module -> the jetrl modules it imports, anywhere in the file: inside functions and under
    ``if TYPE_CHECKING:`` too (a type-only import is still an arrow). A module's own packages are left out
    (importing ``jetrl.rl.losses`` runs ``jetrl/rl/__init__.py`` first, which is no loop of the module's)."""
    name_of = {p: "jetrl." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py")}
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
        edges[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return edges


def _first_loop(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(module: str, chain: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                return chain + [module, nxt]
            if nxt not in state and (loop := visit(nxt, chain + [module])):
                return loop
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (loop := visit(module, [])):
            return loop[loop.index(loop[-1]):]
    return None


def test_no_import_loop_anywhere():
    """No import cycle among jetrl's modules, counting imports inside functions and type-only ones too
    (the trainer and the metrics once imported each other, one side under TYPE_CHECKING)."""
    loop = _first_loop(_import_graph())
    assert loop is None, f"import loop: {' -> '.join(loop)}"


def test_the_loop_finder_finds_a_type_only_loop():
    edges = {"jetrl.rl.metrics": {"jetrl.rl.trainer"}, "jetrl.rl.trainer": {"jetrl.rl.metrics", "jetrl.config"},
             "jetrl.config": set()}
    assert _first_loop(edges) == ["jetrl.rl.metrics", "jetrl.rl.trainer", "jetrl.rl.metrics"]
