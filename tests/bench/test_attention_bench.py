"""bench/attention.py on CPU: its --tiny run end to end under the Triton interpreter (in a child), and the pieces
that decide what a row says: a config that gives a wrong result is reported failed and never timed, byte counts,
ratios, the best-row table, the command line's checks."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from bench import attention
from interpreted import run_interpreted

_CHILD = r'''
import contextlib, io, json, os, sys, tempfile
out_dir = tempfile.mkdtemp()
os.environ["OUT"] = out_dir
from bench import attention
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    report = attention.main(["--tiny", "--settings", "3x40", "--grid-routes", "bytes-hm", "--split-waves", "8"])
with open(os.path.join(out_dir, "attention.json")) as f:
    written = json.load(f)
# no time left for the grid: the default rows only. What this checks is the budget, not the kernels (the run above
# ran them), so each row's measurement is a stand-in
attention.measure = lambda *args: {"status": "ok", "err": 0.0, "us": 1.0}
hurried_out = io.StringIO()
with contextlib.redirect_stdout(hurried_out):
    hurried = attention.main(["--tiny", "--settings", "3x40", "--max-seconds", "0"])
json.dump({"report": report, "written": written, "printed": printed.getvalue(), "hurried": hurried,
           "hurried_printed": hurried_out.getvalue()}, sys.stdout)
'''


@pytest.fixture(scope="module")
def tiny():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    return run_interpreted(_CHILD, "bench/attention.py --tiny", timeout=600)


def test_tiny_run_end_to_end(tiny):
    report = tiny["report"]
    assert tiny["written"] == report  # $OUT/attention.json
    assert report["dtype"] == "torch.float32" and report["copy_gbps"] is None
    rows = report["rows"]
    settings = ["3x40"]  # one setting: the interpreter is slow (the parser's tests cover the list)
    # per setting: the three routes at their default launch, then 2 tiles x 1 wave setting on the grid's route (one
    # route: the grid is the same code for each, and the interpreter is slow)
    assert [r["setting"] for r in rows] == [s for s in settings for _ in range(3 + 2)]
    assert [r["route"] for r in rows] == ["bf16", "kv8-inreg", "kv8-bytes-hm", "kv8-bytes-hm", "kv8-bytes-hm"]
    # the FP8 routes' default launch (1 stage, 128 registers at most), then the grid's (its own stages and no cap)
    assert [r["config"] for r in rows] == ["n64w4s2x2m16", "n64w4s1x2m16r128", "n128w4s1x2m16r128",
                                           "n16w4s2x8m16", "n32w4s2x8m16"]
    for r in rows:
        assert r["status"] == "ok" and r["err"] < 1e-5 and r["us"] > 0, r
        assert r["bytes"] == attention.bytes_moved(attention.TINY_HEADS, *map(int, r["setting"].split("x")),
                                                   fp8=r["route"] != "bf16")
        assert math.isclose(r["gbps"], r["bytes"] / r["us"] / 1e3)
        assert r["vs_bf16"] > 0 and math.isclose(r["of_ceiling"], r["vs_bf16"] / r["ceiling"])
    assert rows[3]["splits"] == 3  # 3 sequences x 2 KV heads, 8 waves of the CPU's 4 "SMs": ceil(32 / 6) = 6, 3 tiles
    best = report["best"]
    assert [(r["setting"], r["route"]) for r in best] == [(s, route) for s in settings for route in attention.ROUTES]
    for b in best:
        assert b["us"] == min(r["us"] for r in rows if (r["setting"], r["route"]) == (b["setting"], b["route"]))
    assert "best config per route per setting" in tiny["printed"]
    assert "FAILED" not in tiny["printed"] and report["skipped"] == 0


def test_tiny_run_past_its_budget_skips_the_grid(tiny):
    """No time left for the grid (``--max-seconds 0``): the default rows only, the grid's counted as skipped."""
    report = tiny["hurried"]
    assert [r["route"] for r in report["rows"]] == list(attention.ROUTES)
    assert all(r["status"] == "ok" for r in report["rows"]) and report["skipped"] == 4  # 2 tiles x 2 wave settings
    assert "4 grid row(s) skipped" in tiny["hurried_printed"]


# ------------------------------------------------------------------------------------------------ the pieces


def test_a_wrong_config_is_failed_and_not_timed():
    ref = torch.ones(4, 8)
    calls = []

    def wrong():
        calls.append(1)
        return ref * 1.1

    r = attention.measure(wrong, ref, 1e-2, torch.device("cpu"), calls=5, replays=3)
    assert r["status"] == "failed" and "us" not in r and math.isclose(r["err"], 0.1, rel_tol=1e-5)
    assert len(calls) == 1  # checked once, never timed
    r = attention.measure(lambda: ref * float("nan"), ref, 1e-2, torch.device("cpu"), 5, 3)
    assert r["status"] == "failed" and "us" not in r

    def refused():
        raise RuntimeError("out of resources: shared memory")

    r = attention.measure(refused, ref, 1e-2, torch.device("cpu"), 5, 3)
    assert r == {"status": "error", "error": "RuntimeError: out of resources: shared memory"}
    calls.clear()
    r = attention.measure(lambda: calls.append(1) or ref, ref, 1e-2, torch.device("cpu"), calls=5, replays=3)
    assert r["status"] == "ok" and r["err"] == 0.0 and r["us"] > 0 and len(calls) == 1 + 1 + 5  # check, warm, 5


def test_bytes_at_the_8b_shape():
    shape = attention.LLAMA8B_HEADS
    tokens = 64 * 4352
    q_out = 2 * 64 * 32 * 128 * 2
    tables = 64 * 272 * 4
    assert attention.bytes_moved(shape, 64, 4352, fp8=False) == 2 * tokens * 8 * 128 * 2 + tables + q_out
    fp8_bytes = 2 * tokens * 8 * 128 + 2 * tokens * 8 * 4 + tables + q_out  # E4M3 data and fp32 scales
    assert attention.bytes_moved(shape, 64, 4352, fp8=True) == fp8_bytes


def test_ratios_and_best_rows():
    def row(setting, route, us, grid=False, nbytes=100):
        return {"setting": setting, "route": route, "grid": grid, "us": us, "bytes": nbytes, "gbps": nbytes / us / 1e3}

    rows = [row("a", "bf16", 10.0, nbytes=200), row("a", "kv8-factored", 8.0), row("a", "kv8-factored", 5.0, True),
            {"setting": "a", "route": "kv8-factored", "grid": True, "status": "failed", "err": 1.0},
            row("b", "kv8-inreg", 4.0)]
    attention._fill_ratios(rows, copy_gbps=0.01)
    assert rows[2]["vs_bf16"] == 2.0 and rows[2]["ceiling"] == 2.0 and rows[2]["of_ceiling"] == 1.0
    assert math.isclose(rows[1]["copy_fraction"], 100 / 8.0 / 1e3 / 0.01)
    assert "vs_bf16" not in rows[4] and "vs_bf16" not in rows[3]  # no bf16 row at b; a failed row has no time
    assert attention.best_rows(rows) == [rows[0], rows[2], rows[4]]


def test_command_line_checks():
    assert attention.parse_settings("256x768, 64x4352") == [(256, 768), (64, 4352)]
    for bad in ("256", "0x10", "ax5", ""):
        with pytest.raises(ValueError):
            attention.parse_settings(bad)
    assert [c.name for c in attention.grid("0,64", "4", "2", "2,8", "16")] == [
        "n0w4s2x2m16", "n0w4s2x8m16", "n64w4s2x2m16", "n64w4s2x8m16"]
    assert [c.name for c in attention.parse_configs("n128w4s2r160, n64w2s1x8")] == ["n128w4s2x2m16r160",
                                                                                  "n64w2s1x8m16"]
    for argv in (["--block-n", "8"], ["--num-warps", "3"], ["--split-waves", "0"], ["--grid-routes", "fast"],
                 ["--routes", "kv8-fast"], ["--configs", "n128w4"], ["--configs", "n128w4s2r8"],
                 ["--settings", "12"], ["--tuning", "kv_decode_num_stages=0"]):
        with pytest.raises(SystemExit):  # argparse's usage error, before anything runs
            attention.main(["--tiny", *argv])
