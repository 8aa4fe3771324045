"""Decode attention alone: ``paged_decode`` over a BF16 and an FP8 KV cache, and a sweep of the FP8 kernel's launch.

One call of :func:`jetrl.quant.kernels.paged_attention_triton.paged_decode` (one layer of one decode step; nothing
is multiplied up) at the Llama-3.1-8B head shapes (32 query heads, 8 KV heads, head_dim 128, bf16, pages of 16),
for the decode settings of ``bench/rollout.py`` as ``SEQSxCONTEXT`` (every sequence holding CONTEXT tokens, its pages
scattered through the pool): 256 x 768 (256 x (256 + 1,024) at its mean context), 64 x 4352 (64 x (256 + 8,192))
and 64 x 768. Rows per setting:

* ``bf16``: the BF16 cache, the kernel's fixed launch (the baseline every ratio is against);
* ``kv8-inreg``: the FP8 cache (E4M3 K/V, one fp32 power-of-two scale per token and KV head), each tile dequantized
  in registers (``kv_decode_factored=false``), the tuning's default launch;
* ``kv8-bytes-hm``: the factored route (``kv_decode_factored=true``: E4M3 tiles converted by bit operations into
  the dots, scales on the fp32 side) on the head-major grid, default launch: the Triton kernel's default route
  (every ``kv8-`` route above runs the Triton kernel: ``kv_decode_streams=false``);
* ``kv8-streams``: the Gluon warp-stream kernel (:mod:`jetrl.quant.kernels.paged_attention_gluon`), the default for
  an FP8 cache where it applies, at the tuning's ``kv_decode_stream_*`` launch (``--tuning`` sets them; the grid
  below is the Triton kernel's);
* the grid: every combination of ``--block-n``, ``--num-warps``, ``--num-stages``, ``--split-waves``,
  ``--max-splits`` and ``--max-registers``, or the configs listed by ``--configs`` (the tuning's ``kv_decode_*``
  launch fields), on each route of ``--grid-routes`` (a route's name without ``kv8-``).

``--routes`` picks the routes of the default-launch rows (by default ``bf16``, ``kv8-inreg``, ``kv8-bytes-hm``
and, on the GPU, ``kv8-streams``; ``bf16`` always runs, every ratio is against it).

Every row is first checked against ``jetrl.models.attention.paged_attention_reference`` in fp32 over the same
(dequantized) cache: a relative error norm above the GPU tests' tolerance (1e-2 in bf16) marks the row ``failed``
and it is not timed; a launch that raises (e.g. too much shared memory) is ``error``. Timing: on CUDA, ``--calls``
calls captured in one CUDA graph, ``--replays`` replays timed with CUDA events, the median per call; on CPU a
host timer. Per row: microseconds per call, the splits the launch chose, bytes (K/V data, scales, the block-table
entries used, q read and the output written: what a kernel must move, not the split partials), achieved GB/s,
its fraction of a measured device-to-device copy (read + write), the speed-up over ``bf16`` at the setting
(``vs_bf16``), the bytes ceiling of that speed-up (``bf16`` bytes over the row's) and the fraction of it reached.
Grid rows not started within ``--max-seconds`` are skipped and counted (the report is written after each setting,
so a run cut short keeps what it measured). The best passing config per route per setting comes last, as a short
table; ``--json PATH`` and ``$OUT/attention.json`` (``bench.common.write_report``) get everything. The K/V of
64 x 768 in FP8 is about 100 MB, more than an H200's L2, so even the smallest setting mostly streams from HBM.

``--tiny``: a CPU smoke run under the Triton interpreter (``TRITON_INTERPRET=1``, set by this flag when Triton is
not yet imported) at small shapes, fp32 queries and caches (the interpreter's bf16 dots are not IEEE), the same
checks and report, in seconds. GPU: ``python bench/attention.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

import torch

try:  # repository root on sys.path (python -m bench.attention, the tests)
    from bench.common import add_tuning_argument, device_description, parse_tuning, sync, write_report
except ModuleNotFoundError:  # python bench/attention.py: bench/ itself is on sys.path
    from common import add_tuning_argument, device_description, parse_tuning, sync, write_report  # type: ignore

_TRITON = {"kv_decode_streams": False}  # the Triton kernel's routes (the Gluon kernel takes FP8 steps by default)
ROUTE_TUNING = {"bf16": {}, "kv8-inreg": dict(_TRITON, kv_decode_factored=False),
                "kv8-bytes-hm": dict(_TRITON, kv_decode_factored=True),
                "kv8-streams": {"kv_decode_streams": True}}
ROUTES = ("bf16", "kv8-inreg", "kv8-bytes-hm")  # the default rows (--tiny: CPU, Triton only)
GPU_ROUTES = (*ROUTES, "kv8-streams")  # the default rows on the GPU (the last: the default route)
GRID_ROUTES = {r.removeprefix("kv8-"): r for r in ROUTE_TUNING if r not in ("bf16", "kv8-streams")}
SETTINGS = "256x768,64x4352,64x768"
TINY_SETTINGS = "3x40,2x100"


@dataclass(frozen=True)
class Shape:
    """Attention heads of the benchmarked model, the cache's page size and the query's dtype."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page: int
    dtype: torch.dtype

    @property
    def tolerance(self) -> float:
        """Largest relative error norm against the fp32 reference: bf16 rounds P and the output (~3e-3, the GPU
        tests' 1e-2); fp32 differs by summation order only."""
        return 1e-2 if self.dtype == torch.bfloat16 else 1e-5


LLAMA8B_HEADS = Shape(num_heads=32, num_kv_heads=8, head_dim=128, page=16, dtype=torch.bfloat16)
TINY_HEADS = Shape(num_heads=4, num_kv_heads=2, head_dim=32, page=8, dtype=torch.float32)


@dataclass(frozen=True)
class Config:
    """One launch of the FP8 kernel: the tuning's ``kv_decode_*`` fields (``block_n`` 0: the route's own tile)."""

    block_n: int = 0
    num_warps: int = 4
    num_stages: int = 2
    split_waves: float = 2.0
    max_splits: int = 16
    max_registers: int = 0

    @property
    def name(self) -> str:
        """e.g. ``n128w4s2x2m16`` (tile tokens, warps, stages, split waves, split cap; ``n0``: the route's tile;
        ``r128``: at most 128 registers per thread)."""
        return (f"n{self.block_n}w{self.num_warps}s{self.num_stages}x{self.split_waves:g}"
                f"m{self.max_splits}" + (f"r{self.max_registers}" if self.max_registers else ""))

    def tuning(self) -> dict:
        return {"kv_decode_block_n": self.block_n, "kv_decode_num_warps": self.num_warps,
                "kv_decode_num_stages": self.num_stages, "kv_decode_split_waves": float(self.split_waves),
                "kv_decode_max_splits": self.max_splits, "kv_decode_max_registers": self.max_registers}


_CONFIG_NAME = re.compile(r"n(\d+)w(\d+)s(\d+)(?:x(\d+(?:\.\d+)?))?(?:m(\d+))?(?:r(\d+))?")


def parse_configs(text: str) -> list[Config]:
    """``"n128w4s2r160,n64w2s1x8"`` -> configs, each named as :attr:`Config.name` writes it, the split waves
    (``x``, default 2), split cap (``m``, default 16) and register cap (``r``, default 0) optional; each checked by
    the tuning object."""
    from jetrl.quant.kernels import tuning

    configs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        match = _CONFIG_NAME.fullmatch(item)
        if not match:
            raise ValueError(f"a config is n<tokens>w<warps>s<stages>[x<waves>][m<splits>][r<registers>], got {item!r}")
        n, w, st, x, m, r = match.groups()
        configs.append(Config(int(n), int(w), int(st), float(x or 2.0), int(m or 16), int(r or 0)))
        with tuning.override(**configs[-1].tuning()):
            pass
    if not configs:
        raise ValueError(f"no config in {text!r}")
    return configs


def parse_settings(text: str) -> list[tuple[int, int]]:
    """``"256x768,64x4352"`` -> ``[(256, 768), (64, 4352)]`` (sequences x context tokens)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        seqs, sep, ctx = item.partition("x")
        if not (sep and seqs.isdigit() and ctx.isdigit() and int(seqs) > 0 and int(ctx) > 0):
            raise ValueError(f"a setting is SEQSxCONTEXT with positive ints, got {item!r}")
        out.append((int(seqs), int(ctx)))
    if not out:
        raise ValueError(f"no setting in {text!r}")
    return out


def _numbers(text: str, kind):
    values = [kind(t) for t in text.split(",") if t.strip()]
    if not values:
        raise ValueError(f"empty list {text!r}")
    return values


def grid(block_n: str, num_warps: str, num_stages: str, split_waves: str, max_splits: str,
         max_registers: str = "0") -> list[Config]:
    """The cross product of comma lists, each config checked by the tuning object (a bad value is an error here,
    before anything runs)."""
    from jetrl.quant.kernels import tuning

    configs = [Config(*c) for c in itertools.product(_numbers(block_n, int), _numbers(num_warps, int),
                                                      _numbers(num_stages, int), _numbers(split_waves, float),
                                                      _numbers(max_splits, int), _numbers(max_registers, int))]
    for config in configs:
        with tuning.override(**config.tuning()):
            pass
    return configs


# ------------------------------------------------------------------------------------------------ the cases


@dataclass
class Case:
    """One setting's inputs: q, the BF16 (q's dtype) cache, its FP8 quantization, the metadata and references."""

    num_seqs: int
    context: int
    q: torch.Tensor
    meta: object
    k: torch.Tensor
    v: torch.Tensor
    kd: torch.Tensor
    ks: torch.Tensor
    vd: torch.Tensor
    vs: torch.Tensor
    ref: torch.Tensor  # fp32 attention over the cache in q's dtype
    ref8: torch.Tensor  # fp32 attention over the dequantized FP8 cache


def make_case(shape: Shape, num_seqs: int, context: int, device: torch.device, seed: int = 0) -> Case:
    """``num_seqs`` sequences of ``context`` tokens each, pages drawn at random from the pool (one spare block)."""
    from jetrl.models.attention import (PagedAttentionMetadata, dequantize_kv, paged_attention_reference,
                                        quantize_kv)

    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-context // shape.page)
    num_blocks = num_seqs * pages + 1
    tables = torch.randperm(num_blocks, generator=gen, device=device)[:num_seqs * pages]
    tables = tables.view(num_seqs, pages).to(torch.int32)
    pool = (num_blocks, shape.page, shape.num_kv_heads, shape.head_dim)
    k = torch.randn(pool, generator=gen, device=device).to(shape.dtype)
    v = torch.randn(pool, generator=gen, device=device).to(shape.dtype)
    q = torch.randn(num_seqs, shape.num_heads, shape.head_dim, generator=gen, device=device).to(shape.dtype)
    kd, ks = quantize_kv(k)
    vd, vs = quantize_kv(v)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        context_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device), block_tables=tables,
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long, device=device), max_query_len=1,
        max_context_len=context)
    scale = shape.head_dim ** -0.5
    ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, scale)
    ref8 = paged_attention_reference(q.float(), dequantize_kv(kd, ks, torch.float32),
                                     dequantize_kv(vd, vs, torch.float32), meta, scale)
    return Case(num_seqs, context, q, meta, k, v, kd, ks, vd, vs, ref, ref8)


def bytes_moved(shape: Shape, num_seqs: int, context: int, fp8: bool) -> int:
    """What one call must move: K and V data (+ their fp32 scales over an FP8 cache), the block-table entries of
    the context, q read and the output written."""
    tokens = num_seqs * context
    elem = 1 if fp8 else torch.empty((), dtype=shape.dtype).element_size()
    kv = 2 * tokens * shape.num_kv_heads * shape.head_dim * elem
    scales = 2 * tokens * shape.num_kv_heads * 4 if fp8 else 0
    tables = num_seqs * -(-context // shape.page) * 4
    q_out = 2 * num_seqs * shape.num_heads * shape.head_dim * torch.empty((), dtype=shape.dtype).element_size()
    return kv + scales + tables + q_out


# ------------------------------------------------------------------------------------------------ measuring


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def time_us(fn, device: torch.device, calls: int, replays: int) -> float:
    """Median microseconds per ``fn()`` call: on CUDA ``calls`` calls captured in one graph, each of ``replays``
    replays timed with events; on CPU a host timer over ``calls`` calls (one warm-up first)."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def measure(fn, ref: torch.Tensor, tolerance: float, device: torch.device, calls: int, replays: int) -> dict:
    """Check ``fn()`` against ``ref``, then time it: ``{"status": "ok", "err", "us"}``; ``"failed"`` (error above
    ``tolerance`` or not finite: not timed) or ``"error"`` (the launch raised, e.g. a tile that does not fit)."""
    try:
        out = fn()
        sync(device)
        err = rel_err(out, ref)
    except Exception as exc:  # a config the compiler or the GPU refuses is a row of the sweep, not the end of it
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
    if not err < tolerance:  # NaN fails too
        return {"status": "failed", "err": err}
    try:
        us = time_us(fn, device, calls, replays)
    except Exception as exc:  # e.g. a graph capture the launch does not survive: that row only
        return {"status": "error", "err": err, "error": f"timing: {type(exc).__name__}: {exc}"[:400]}
    return {"status": "ok", "err": err, "us": us}


def copy_bandwidth(device: torch.device) -> float | None:
    """GB/s of a 1 GiB device-to-device copy (bytes read + written, median of 10 event-timed copies); None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / sorted(times)[5] / 1e9


def run_row(shape: Shape, case: Case, route: str, config: Config | None, device: torch.device, calls: int,
            replays: int, splits: int | None = None) -> dict:
    """One row: ``route`` (:data:`ROUTES`) with ``config`` (None: the route's default launch); ``splits`` forces
    the BF16 route's context split (a ``--bf16-splits`` row)."""
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.paged_attention_triton import choose_num_splits, launch_config, paged_decode

    fp8 = route != "bf16"
    settings = dict(ROUTE_TUNING[route], **(config.tuning() if config else {}))
    scale = shape.head_dim ** -0.5
    if fp8:
        fn = lambda: paged_decode(case.q, case.kd, case.vd, case.meta, scale, case.ks, case.vs)  # noqa: E731
    else:
        fn = lambda: paged_decode(case.q, case.k, case.v, case.meta, scale, num_splits=splits)  # noqa: E731
    with tuning.override(**settings):
        knobs = tuning.current()
        if route == "kv8-streams":  # the Gluon kernel's launch (tuning's kv_decode_stream_*)
            from jetrl.quant.kernels.decode_splits import sm_count
            from jetrl.quant.kernels.paged_attention_gluon import num_splits
            from jetrl.quant.kernels.paged_attention_triton import _streams_apply

            if not _streams_apply(case.q, case.kd, case.vd, case.ks, case.vs):
                return {"setting": f"{case.num_seqs}x{case.context}", "route": route, "config": "-",
                        "grid": False, "splits": 0, "status": "error",
                        "error": "the Gluon kernel does not apply here (CPU, no Gluon, or shapes it does not take)"}
            launch = {"num_warps": knobs.kv_decode_stream_warps, "num_stages": knobs.kv_decode_stream_stages,
                      "split_waves": knobs.kv_decode_stream_waves, "max_splits": knobs.kv_decode_stream_max_splits,
                      "max_registers": knobs.kv_decode_stream_max_registers}
            name = "w{num_warps}s{num_stages}x{split_waves:g}m{max_splits}".format(**launch) + (
                f"r{launch['max_registers']}" if launch["max_registers"] else "")
            splits = num_splits(case.num_seqs, shape.num_kv_heads, case.context, sm_count(case.q.device),
                                launch["num_warps"], launch["split_waves"], launch["max_splits"])
        else:
            triton_launch = launch_config(fp8, fp8 and shape.dtype != torch.float16 and knobs.kv_decode_factored)
            launch = asdict(triton_launch)
            name = Config(triton_launch.block_n, triton_launch.num_warps, triton_launch.num_stages,
                          triton_launch.split_waves, triton_launch.max_splits, triton_launch.max_registers).name
            if splits is None:
                splits = choose_num_splits(case.num_seqs, shape.num_kv_heads, case.context, case.q.device,
                                           triton_launch.block_n, triton_launch.split_waves, triton_launch.max_splits)
            else:
                name = f"{name}@{splits}"
        result = measure(fn, case.ref8 if fp8 else case.ref, shape.tolerance, device, calls, replays)
    row = {"setting": f"{case.num_seqs}x{case.context}", "route": route, "config": name,
           "grid": config is not None or name.count("@") > 0, **launch, "splits": splits,
           "bytes": bytes_moved(shape, case.num_seqs, case.context, fp8), **result}
    if "us" in row:
        row["gbps"] = row["bytes"] / row["us"] / 1e3
    return row


def _fill_ratios(rows: list[dict], copy_gbps: float | None) -> None:
    base = {r["setting"]: r for r in rows if r["route"] == "bf16" and not r["grid"] and "us" in r}
    for r in rows:
        if "us" not in r:
            continue
        if copy_gbps:
            r["copy_fraction"] = r["gbps"] / copy_gbps
        b = base.get(r["setting"])
        if b is not None:
            r["vs_bf16"] = b["us"] / r["us"]
            r["ceiling"] = b["bytes"] / r["bytes"]
            r["of_ceiling"] = r["vs_bf16"] / r["ceiling"]


def best_rows(rows: list[dict]) -> list[dict]:
    """The fastest passing row per (setting, route), in the rows' order."""
    best: dict = {}
    for r in rows:
        if "us" in r and ((r["setting"], r["route"]) not in best or r["us"] < best[r["setting"], r["route"]]["us"]):
            best[r["setting"], r["route"]] = r
    return list(best.values())


def _line(r: dict) -> str:
    head = f"{r['setting']:>9} {r['route']:<13} {r['config']:<16} {r['splits']:>3}"
    if "us" not in r:
        what = f"err {r['err']:.2e}" if r["status"] == "failed" else r["error"][:70]
        return f"{head}  {r['status'].upper()}: {what}"
    frac = f"{r['copy_fraction']:6.1%}" if "copy_fraction" in r else "     -"
    ratio = (f"{r['vs_bf16']:5.2f}x {r['ceiling']:5.2f}x {r['of_ceiling']:6.1%}" if "vs_bf16" in r
             else "     -      -       -")
    return (f"{head} {r['us']:9.1f} {r['bytes'] / 1e6:9.1f} {r['gbps']:8.1f} {frac} {ratio} {r['err']:.1e}")


HEADER = (f"{'setting':>9} {'route':<13} {'config':<16} {'spl':>3} {'us/call':>9} {'MB':>9} {'GB/s':>8} "
          f"{'copy%':>6} {'vsbf16':>6} {'ceil':>6} {'ofceil':>7} err")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=None, help=f"SEQSxCONTEXT comma list (default {SETTINGS}; "
                                                          f"--tiny: {TINY_SETTINGS})")
    parser.add_argument("--routes", default=None,
                        help=f"routes of the default-launch rows, comma-separated, from {','.join(ROUTE_TUNING)} "
                             f"(default {','.join(GPU_ROUTES)}; --tiny {','.join(ROUTES)}; bf16 always runs)")
    parser.add_argument("--grid-routes", default="bytes-hm", help="routes of the Triton kernel the grid runs on: "
                                                                   "bytes-hm (its default route), "
                                                                   f"{', '.join(r for r in GRID_ROUTES if r != 'bytes-hm')}, "
                                                               "several comma-separated, or none")
    parser.add_argument("--block-n", default=None, help="tokens per FP8 tile (0: the route's own; default 64,128,256;"
                                                         " --tiny 16,32)")
    parser.add_argument("--num-warps", default=None, help="default 4,8 (--tiny 4)")
    parser.add_argument("--num-stages", default=None, help="default 2,3 (--tiny 2)")
    parser.add_argument("--split-waves", default=None, help="waves of programs the context split aims for "
                                                             "(default 2,8,32; --tiny 2,8)")
    parser.add_argument("--max-splits", default="16", help="cap on the context split (default 16)")
    parser.add_argument("--max-registers", default="0", help="cap on registers per thread, 0: the compiler's "
                                                              "(default 0)")
    parser.add_argument("--configs", default=None, help="the grid as a list of config names instead of the cross "
                                                         "product, e.g. n128w4s2r160,n64w2s1x8 (x: split waves, "
                                                         "m: split cap, r: register cap; optional)")
    parser.add_argument("--calls", type=int, default=None, help="calls per CUDA graph (default 20; --tiny 1)")
    parser.add_argument("--replays", type=int, default=10, help="timed graph replays, median taken (default 10)")
    parser.add_argument("--max-seconds", type=float, default=480.0,
                        help="time budget: grid rows not started by then are skipped (counted in the report; the "
                             "routes' default rows always run); default 480")
    parser.add_argument("--heads", default=None, help="QUERY:KV:HEAD_DIM heads of the model (default 32:8:128, "
                                                       "Llama-3.1-8B's; e.g. 12:2:128 Qwen2-1.5B, 14:2:64 Qwen2.5-0.5B)")
    parser.add_argument("--bf16-splits", default=None, help="comma list of context splits: BF16-cache rows with "
                                                             "each forced (besides the default split)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run under the Triton interpreter")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")
    add_tuning_argument(parser)
    args = parser.parse_args(argv)
    tiny = args.tiny
    try:
        settings = parse_settings(args.settings or (TINY_SETTINGS if tiny else SETTINGS))
        if args.configs:
            configs = parse_configs(args.configs)
        else:
            configs = grid(args.block_n or ("16,32" if tiny else "64,128,256"),
                           args.num_warps or ("4" if tiny else "4,8"), args.num_stages or ("2" if tiny else "2,3"),
                           args.split_waves or ("2,8" if tiny else "2,8,32"), args.max_splits, args.max_registers)
        names = [r.strip() for r in args.grid_routes.split(",") if r.strip() and r.strip() != "none"]
        unknown = sorted(set(names) - set(GRID_ROUTES))
        if unknown:
            raise ValueError(f"--grid-routes: unknown route(s) {unknown}; choose from {list(GRID_ROUTES)} or none")
        grid_routes = [GRID_ROUTES[r] for r in names]
        routes = [r.strip() for r in (args.routes or ",".join(ROUTES if tiny else GPU_ROUTES)).split(",") if r.strip()]
        unknown = sorted(set(routes) - set(ROUTE_TUNING))
        if unknown:
            raise ValueError(f"--routes: unknown route(s) {unknown}; choose from {list(ROUTE_TUNING)}")
        routes = ["bf16", *(r for r in ROUTE_TUNING if r in routes and r != "bf16")]
    except ValueError as exc:
        parser.error(str(exc))
    outer = parse_tuning(parser, args.tuning)
    if tiny:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("bench/attention.py --tiny: Triton was imported without TRITON_INTERPRET=1; run it in "
                             "a fresh process")
        os.environ["TRITON_INTERPRET"] = "1"
        device, shape = torch.device("cpu"), TINY_HEADS
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/attention.py needs a CUDA GPU (use --tiny for a CPU smoke run)")
        device, shape = torch.device("cuda"), LLAMA8B_HEADS
    if args.heads:
        try:
            hq, hkv, hd = (int(x) for x in args.heads.split(":"))
            if hq < 1 or hkv < 1 or hd < 1 or hq % hkv:
                raise ValueError
        except ValueError:
            parser.error(f"--heads is QUERY:KV:HEAD_DIM, positive ints, QUERY a multiple of KV; got {args.heads!r}")
        shape = Shape(hq, hkv, hd, shape.page, shape.dtype)
    bf16_splits = _numbers(args.bf16_splits, int) if args.bf16_splits else []
    calls = args.calls or (1 if tiny else 20)
    from jetrl.quant.kernels import tuning

    copy_gbps = copy_bandwidth(device)
    report = {"device": device_description(device), "copy_gbps": copy_gbps, "dtype": str(shape.dtype),
              "shape": {"num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
                        "head_dim": shape.head_dim, "page": shape.page},
              "tuning": outer, "calls": calls, "replays": args.replays, "rows": [], "skipped": 0}
    copy_text = f"copy {copy_gbps:.0f} GB/s" if copy_gbps else "no copy bandwidth on CPU"
    print(f"{report['device']}, {copy_text}, {shape.dtype}, grid of {len(configs)} configs on "
          f"{grid_routes or 'no route'}", flush=True)
    print(HEADER, flush=True)
    started = time.perf_counter()
    with tuning.override(**outer):
        for num_seqs, context in settings:
            case = make_case(shape, num_seqs, context, device)
            rows = [run_row(shape, case, route, None, device, calls, args.replays) for route in routes]
            rows += [run_row(shape, case, "bf16", None, device, calls, args.replays, splits=n) for n in bf16_splits]
            for route in grid_routes:
                for config in configs:
                    if time.perf_counter() - started > args.max_seconds:
                        report["skipped"] += 1
                        continue
                    rows.append(run_row(shape, case, route, config, device, calls, args.replays))
            _fill_ratios(rows, copy_gbps)
            for r in rows:
                print(_line(r), flush=True)
            report["rows"] += rows
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_report(report, args.json, "attention.json")  # so far (a run cut short keeps its settings)
    report["seconds"] = time.perf_counter() - started
    report["best"] = best_rows(report["rows"])
    print(f"\nbest config per route per setting ({report['seconds']:.0f} s in all)\n{HEADER}")
    for r in report["best"]:
        print(_line(r))
    failed = [r for r in report["rows"] if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} row(s) failed or errored (listed above, not timed)")
    if report["skipped"]:
        print(f"{report['skipped']} grid row(s) skipped: past --max-seconds {args.max_seconds:g}")
    write_report(report, args.json, "attention.json")
    return report


if __name__ == "__main__":
    main()
