"""The DeepGEMM route's rule and plan on the CPU (the kernels themselves: tests/quant/test_deepgemm_gpu.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from jetrl.quant.kernels import deepgemm_builds as builds
from jetrl.quant.kernels import gemm_deepgemm as dg
from jetrl.quant.kernels import tuning
from jetrl.rl.micro_batch import round_up


def test_the_rule_takes_decode_sized_gemms_except_long_k_weights_up_to_the_split_k_bound():
    """The rule reads the GEMM's shape alone: the rows of a rollout's decode step, or of a training micro-batch
    that small, go to DeepGEMM; prefill and training-sized GEMMs (Fprop and DGrad) to the default route."""
    rule = tuning.KernelTuning().deepgemm_rule()
    assert rule["decode_max_m"] == 256 and rule["split_k_max_m"] == 128

    def where(m, n, k, **kw):
        return dg.route(m, n, k, **{**rule, **kw})

    for m in (1, 3, 16, 100, 256):
        assert where(m, 2048, 1536) == "deepgemm"  # q/k/v stacked, o, gate/up: K <= 2N
        assert where(m, 17920, 1536) == "deepgemm"
        assert where(m, 1536, 3072) == "deepgemm"
        for n, k in ((1536, 8960), (3584, 18944), (896, 4864)):  # down projections, 1.5B / 7B / 0.5B
            assert where(m, n, k) == ("deepgemm" if m > 128 else "decode")  # split-K's case up to 128 rows
        # a grouped launch with biases (the caller's decode bound) keeps the decode kernel up to that bound
        assert where(m, 4608, 3584, decode_bound=64) == ("deepgemm" if m > 64 else "decode")
    assert where(257, 2048, 1536) is None  # above the decode bound: the default route's
    assert where(16, 2048, 1536, decode_max_m=0) is None  # the decode route off
    # training-sized GEMMs (a micro-batch's Fprop, its DGrad against W^T) stay on the default route
    assert where(2048, 2048, 1536) is None and where(15360, 17920, 1536) is None and where(4099, 1536, 8960) is None


def test_no_kernel_module_reads_the_precision_side():
    """GEMM routing (and every other kernel choice) decides from the operands and the tuning, not from which
    phase runs it: only the recipe's choice of precision per side (quant/linear.py) reads the side."""
    import pathlib

    import jetrl.quant

    root = pathlib.Path(jetrl.quant.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "current_side" in p.read_text() and p.name not in ("side.py", "__init__.py"))
    assert readers == ["linear.py"]


def test_the_plan_covers_no_training_rows():
    seen = {(2048, 1536), (1536, 2048)}
    buckets = sorted({round_up(t, 128) for t in range(1024, 4097, 128)})
    assert not dg.planned_shapes(buckets, seen, **tuning.KernelTuning().deepgemm_rule())


def test_the_plan_covers_the_decode_graph_sizes():
    """The rollout's decode graphs ask for their row counts: gate/up and o at every size, the down projection
    (K > 2N) above the split-K bound only, and the stacked q/k/v with biases above its decode bound only."""
    seen = {(2048, 1536), (17920, 1536), (1536, 1536), (1536, 8960)}
    sizes = [1, 2, 4, 8, 16, 32, 128, 144, 256]
    plan = dg.planned_shapes(sizes, seen, **tuning.KernelTuning().deepgemm_rule(),
                             decode_bound=lambda n, k: 64 if (n, k) == (2048, 1536) else 0)
    assert sorted(plan, key=lambda s: (s.n, s.k, s.m)) == sorted(
        [dg.GemmShape(m, n, 1536) for n in (17920, 1536) for m in sizes]
        + [dg.GemmShape(m, 2048, 1536) for m in (128, 144, 256)]
        + [dg.GemmShape(m, 1536, 8960) for m in (144, 256)], key=lambda s: (s.n, s.k, s.m))


@pytest.mark.parametrize("field", ["deepgemm_decode_max_m", "deepgemm_split_k_max_m"])
def test_tuning_checks_the_rule_bounds(field):
    with pytest.raises(ValueError, match=field):
        tuning.KernelTuning(**{field: -1})
    assert "deepgemm" in tuning.GEMM_CHOICES
    if field == "deepgemm_split_k_max_m":  # the decode kernel keeps those rows: at most its 256
        with pytest.raises(ValueError, match=field):
            tuning.KernelTuning(deepgemm_split_k_max_m=257)


def test_deepgemm_is_an_error_where_it_is_not_installed():
    """``gemm="deepgemm"`` without DeepGEMM installed is refused when the setting is made (a config's ``kernels:``
    is checked before the model loads), not at the first GEMM."""
    import importlib.util

    if importlib.util.find_spec("deep_gemm") is not None:
        pytest.skip("DeepGEMM is installed here")
    with pytest.raises(ValueError, match="needs DeepGEMM"):
        tuning.KernelTuning(gemm="deepgemm")
    from jetrl.config.schema import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="needs DeepGEMM"):
        RunConfig(kernels=("gemm=deepgemm",)).validate()


def test_shapes_deepgemm_cannot_take_are_not_compiled():
    assert dg._takes(dg.GemmShape(2048, 2048, 1536)) and dg._takes(dg.GemmShape(3, 1536, 1536))
    assert not dg._takes(dg.GemmShape(2048, 1000, 1536))  # a weight width that is not whole tiles
    assert not dg._takes(dg.GemmShape(2048, 2048, 1000))


def test_compile_workers_share_the_cpus_between_the_jobs_processes(monkeypatch):
    """Each process of a torchrun job on one machine starts its share of the CPUs in compile workers (each holds a
    CUDA context on that process's GPU), at most 8 and at least 1."""
    import os

    cpus = os.cpu_count() or 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert dg.default_workers() == max(1, min(8, cpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert dg.default_workers() == max(1, min(8, cpus // 8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cpus))
    assert dg.default_workers() == 1


def test_the_plan_reads_the_models_fp8_weights_after_a_forward():
    """prepare_gemms plans for the FP8 weights a model's forwards multiplied (no process-wide record of GEMMs):
    q/k/v stacked with their biases (a Qwen2 model), gate/up stacked, o and down alone, each once."""
    import torch

    from jetrl.models import DecoderConfig, build_model
    from jetrl.quant import precision_side
    from jetrl.quant.backend import GemmWeight
    from jetrl.quant.linear import forward_gemm_weights

    config = DecoderConfig(model_type="qwen2", vocab_size=300, hidden_size=256, intermediate_size=384,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=64, eos_token_id=1, qkv_bias=True)
    model = build_model(config, dtype=torch.float32, device="cpu", recipe="jet", seed=0)
    with precision_side("rollout"):
        assert forward_gemm_weights(model) == []  # nothing multiplied yet
        with torch.no_grad():
            model(torch.randint(2, 300, (1, 7), generator=torch.Generator().manual_seed(1)))
        got = forward_gemm_weights(model)
    assert sorted(got) == sorted([GemmWeight(512, 256, biased_group=True), GemmWeight(768, 256),
                                  GemmWeight(256, 256), GemmWeight(256, 384)])


def test_a_pypi_build_for_another_torch_is_refused_with_the_builds_that_match():
    """sgl-deep-gemm's builds name no torch, yet each runs on one only (on another, every tensor reads as
    0-dimensional in its first check): the route says which build matches instead of failing inside the GEMM."""
    problem = builds.build_problem("0.2.1", "2.11.0+cu130")
    assert "built against torch 2.13" in problem and "2.11.0+cu130" in problem
    assert "0.1.4.post1" in problem and "0.2.1," not in problem  # the torch 2.11 builds, and only those
    assert problem.endswith("(pip install sgl-deep-gemm==0.1.4.post1)")  # the recommended one
    assert builds.builds_for("2.14.0").endswith("(pip install sgl-deep-gemm==0.2.5)")  # 0.2.5 > 0.2.1.post1 > 0.1.8rc0
    assert builds.build_problem("0.2.5", "2.13.0") is not None
    assert builds.build_problem("0.2.1", "2.12.1").endswith("no sgl-deep-gemm build is known for torch 2.12")
    for version, torch_version in (("0.1.4.post1", "2.11.0+cu130"), ("0.2.1", "2.13.0+cpu"), ("0.2.5", "2.14.1")):
        assert builds.build_problem(version, torch_version) is None
    # the named build is the recommended one where there is one (torch 2.11's ran the GPU tests), not the newest
    assert "0.1.5.post1" in problem and builds.build_problem("0.1.5.post1", "2.13.0") is not None
    assert builds.build_problem("0.2.4rc0", "2.14.0") is not None and builds.build_problem("0.2.4rc0", "2.15.0") is None
    assert builds.build_problem(None, "2.11.0") is None  # DeepGEMM built from source: compiled against this torch
    assert builds.build_problem("9.9.9", "2.11.0") is None  # a build jetrl has not seen: left to load and run


def test_the_deepgemm_extras_pin_the_recommended_build_for_each_torch_jetrl_runs_on():
    """``pip install 'jetrl[deepgemm-torch2-11]'`` (pip before 24 does not read ``2.11`` as ``2-11``) installs the
    build the config check and its messages name for that torch: the extras and the table agree, for every torch
    jetrl supports (2.11 and 2.13)."""
    import pathlib
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    pins = {}
    for extra, requirements in project["optional-dependencies"].items():
        if (found := re.fullmatch(r"deepgemm-torch(\d+)-(\d+)", extra)) is not None:
            assert len(requirements) == 1 and requirements[0].startswith("sgl-deep-gemm=="), requirements
            pins[f"{found[1]}.{found[2]}.0"] = requirements[0].removeprefix("sgl-deep-gemm==")
    assert sorted(pins) == ["2.11.0", "2.13.0"]
    for torch_version, pinned in pins.items():
        assert builds.SGL_DEEP_GEMM_TORCH[pinned] == builds._major_minor(torch_version)
        assert builds.RECOMMENDED[builds._major_minor(torch_version)] == pinned
        assert builds.builds_for(torch_version).endswith(f"(pip install sgl-deep-gemm=={pinned})")


def _fake_deep_gemm(root, message: str) -> None:
    """A ``deep_gemm`` package under ``root`` whose import fails with ``message``, as a broken build's would."""
    (root / "deep_gemm").mkdir(parents=True)
    (root / "deep_gemm" / "__init__.py").write_text(f"raise ImportError({message!r})\n")


def _fake_sgl_build(root, version: str) -> None:
    """:func:`_fake_deep_gemm` as the distribution ``sgl-deep-gemm`` ``version`` provides it, laid out as pip
    installs it (top_level.txt names the package, RECORD its files)."""
    _fake_deep_gemm(root, "the fake PyPI build was imported")
    info = root / f"sgl_deep_gemm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sgl-deep-gemm\nVersion: {version}\n")
    (info / "top_level.txt").write_text("deep_gemm\n")
    (info / "RECORD").write_text(f"deep_gemm/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.mark.parametrize("case", ["none", "this-torch", "source-build", "other-torch", "unknown-release"])
def test_auto_uses_deepgemm_only_where_a_build_known_for_this_torch_loads(tmp_path, case):
    """The default ``gemm="auto"`` routes DeepGEMM's rule where the installed DeepGEMM is this torch's PyPI build or
    a source build and it loads (``loads()``, asked only then); another torch's build and a release jetrl's table
    does not know are left alone with one warning (only ``gemm="deepgemm"`` uses the latter); no DeepGEMM is no
    warning. A forced path and ``deepgemm_decode_max_m=0`` never route there, nor ask."""
    import json

    here = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    version = {"this-torch": next((v for v, t in builds.SGL_DEEP_GEMM_TORCH.items() if t == here), None),
               "other-torch": next(v for v, t in builds.SGL_DEEP_GEMM_TORCH.items() if t != here),
               "unknown-release": "9.9.9"}.get(case, "")
    if version is None:
        pytest.skip(f"no sgl-deep-gemm build in the table is for torch {here[0]}.{here[1]}")
    if case == "source-build":
        _fake_deep_gemm(tmp_path / "site", "the fake source build was imported")
    elif case != "none":
        _fake_sgl_build(tmp_path / "site", version)
    script = textwrap.dedent(f"""
        import json, sys, warnings
        sys.path[:0] = [{str(tmp_path / "site")!r}]
        from jetrl.quant.kernels import tuning
        asked = []
        def loads():
            asked.append(1)
            return True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on = tuning.KernelTuning(gemm="auto").uses_deepgemm(loads)
            off = [tuning.KernelTuning(gemm=g).uses_deepgemm(loads) for g in ("cublas", "triton", "decode")]
            off.append(tuning.KernelTuning(gemm="auto", deepgemm_decode_max_m=0).uses_deepgemm(loads))
            again = tuning.KernelTuning().uses_deepgemm(lambda: False)  # DeepGEMM does not load: no route
        print(json.dumps(dict(on=on, off=off, again=again, asked=len(asked), warned=[str(w.message) for w in caught])))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["off"] == [False] * 4 and got["again"] is False
    usable = case in ("this-torch", "source-build")
    assert got["on"] is usable and got["asked"] == int(usable)
    if case in ("none", "this-torch", "source-build"):
        assert got["warned"] == []
    else:
        assert len(got["warned"]) == 1 and got["warned"][0].startswith(
            "DeepGEMM is installed, but gemm=auto does not use it: ")
        assert ("is built against torch" if case == "other-torch" else "is not in jetrl's table") in got["warned"][0]


@pytest.mark.parametrize("case", ["other-torch", "this-torch", "source-build-first"])
def test_gemm_deepgemm_with_a_build_for_another_torch_is_a_config_error(tmp_path, case):
    """The tuning object (read before a model loads) refuses gemm=deepgemm where the installed sgl-deep-gemm is
    another torch's build, naming this torch's builds, without importing it; this torch's build passes the check,
    and so does DeepGEMM built from source found first on the path beside another torch's PyPI build (the build
    that imports is the one judged). The route's loader agrees: it refuses the other torch's build with a warning
    before importing it, and imports the others (whose import here fails, as a broken build's would: a warning,
    and no DeepGEMM), after which the first GEMM DeepGEMM's rule takes stops with an error that names the way
    out."""
    here = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    matches = case == "this-torch"
    version = next((v for v, t in builds.SGL_DEEP_GEMM_TORCH.items() if (t == here) == matches), None)
    if version is None:
        pytest.skip(f"no sgl-deep-gemm build in the table is for torch {here[0]}.{here[1]}")
    _fake_sgl_build(tmp_path / "site", version)
    paths = [str(tmp_path / "site")]
    if case == "source-build-first":
        _fake_deep_gemm(tmp_path / "src", "the fake source build was imported")
        paths.insert(0, str(tmp_path / "src"))
    script = textwrap.dedent(f"""
        import sys; sys.path[:0] = {paths!r}
        from jetrl.quant.kernels import tuning
        try:
            tuning.KernelTuning(gemm="deepgemm")
        except ValueError as exc:
            print("ERROR", exc)
        else:
            print("OK")
        import warnings
        from jetrl.quant.kernels import gemm_deepgemm
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("installed", gemm_deepgemm.installed())
        print("warned", " | ".join(str(w.message) for w in caught))
        if "OK" in sys.argv:  # a decode-sized GEMM under gemm=deepgemm, where DeepGEMM does not load
            import torch
            from jetrl.quant import reference
            from jetrl.quant.formats import ACT, WEIGHT
            from jetrl.quant.kernels.cuda_backend import gemm_path
            a = reference.quantize_tensor(torch.randn(16, 256), ACT)
            b = reference.quantize_tensor(torch.randn(256, 256), WEIGHT)
            with tuning.override(gemm="deepgemm"):
                try:
                    print("path", gemm_path(a, b))
                except RuntimeError as exc:
                    print("RuntimeError", exc)
    """)
    passes = case != "other-torch"
    out = subprocess.run([sys.executable, "-c", script, "OK" if passes else "ERROR"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "installed False", out.stdout
    if passes:
        which = "PyPI" if matches else "source"
        assert lines[0] == "OK"
        assert lines[2] == f"warned DeepGEMM is installed but does not load (ImportError: the fake {which} build " \
            "was imported)"
        assert lines[3].startswith("RuntimeError the FP8 GEMM path is set to DeepGEMM")  # at the first GEMM it takes
        assert lines[3].endswith(f"{builds.builds_for(torch.__version__)}), or choose another path")
    else:
        assert lines[0].startswith("ERROR") and f"sgl-deep-gemm {version} is built against torch" in lines[0]
        assert f"sgl-deep-gemm's builds for torch {here[0]}.{here[1]} are" in lines[0]
        assert lines[2].startswith("warned DeepGEMM is installed but cannot run here: sgl-deep-gemm") and \
            "does not load" not in lines[2]  # refused before the import


@pytest.mark.skipif(dg.installed(), reason="DeepGEMM is installed here")
def test_choosing_deepgemm_where_it_is_not_installed_says_where_to_get_it():
    with pytest.raises(ValueError, match="needs DeepGEMM.*github.com/deepseek-ai/DeepGEMM.*sgl-deep-gemm"):
        tuning.KernelTuning(gemm="deepgemm")
