"""The FP8-cache decode kernel's launch through the tuning object (``kv_decode_block_n``, ``kv_decode_num_warps``,
``kv_decode_num_stages``, ``kv_decode_split_waves``, ``kv_decode_max_splits``; ``bench/attention.py`` sweeps them).

* the fields' checks, the defaults (today's launch: 128-token tiles on the factored route, 64 in registers, 4 warps,
  2 stages, two waves, at most 16 splits) and the BF16-cache launch, which none of them touches;
* the split policy's formula (``choose_num_splits``);
* under the Triton interpreter (a child, tiny shapes): every config of a small grid, on both FP8 routes (fp32
  queries factored; fp16 queries, which always dequantize in registers), is within the tolerances of
  ``tests/quant/test_kv_fp8_kernels.py`` of ``paged_attention_reference``, and equal to the kernel over the
  dequantized cache at the same tile and split (bitwise in registers; factored to the bit outside results below
  2^-126); the interpreter ignores warps and stages, so the GPU test covers those at the 8B head shapes.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from interpreted import run_interpreted
from test_kv_fp8_kernels import _SHARED, TOL, _decode_case, rel_err

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

FIELDS = ("kv_decode_block_n", "kv_decode_num_warps", "kv_decode_num_stages", "kv_decode_split_waves",
          "kv_decode_max_splits")


@pytest.mark.parametrize("field, value, message", [
    ("kv_decode_block_n", 8, "kv_decode_block_n must be 0 .* or a power of two in 16..256, got 8"),
    ("kv_decode_block_n", 96, "power of two in 16..256, got 96"),
    ("kv_decode_block_n", 512, "power of two in 16..256, got 512"),
    ("kv_decode_num_warps", 3, "kv_decode_num_warps must be a power of two in 1..16, got 3"),
    ("kv_decode_num_warps", 32, "kv_decode_num_warps must be a power of two in 1..16, got 32"),
    ("kv_decode_num_stages", 0, "kv_decode_num_stages must be a positive int, got 0"),
    ("kv_decode_num_stages", 2.0, "kv_decode_num_stages must be a positive int, got 2.0"),
    ("kv_decode_max_splits", 0, "kv_decode_max_splits must be a positive int, got 0"),
    ("kv_decode_max_splits", True, "kv_decode_max_splits must be a positive int, got True"),
    ("kv_decode_split_waves", 0.0, "kv_decode_split_waves must be a positive finite number, got 0.0"),
    ("kv_decode_split_waves", -1, "positive finite number, got -1"),
    ("kv_decode_split_waves", float("inf"), "positive finite number, got inf"),
    ("kv_decode_split_waves", float("nan"), "positive finite number, got nan"),
    ("kv_decode_split_waves", "2", "positive finite number, got '2'"),
])
def test_launch_fields_reject_bad_values(field, value, message):
    from jetrl.quant.kernels import tuning

    with pytest.raises(ValueError, match=message):
        with tuning.override(**{field: value}):
            pass


def test_launch_defaults_are_the_pinned_launch_and_leave_the_bf16_cache_alone():
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.paged_attention_triton import (BF16_LAUNCH, BLOCK_N, FP8_BLOCK_N, DecodeLaunch,
                                                            launch_config)

    assert BF16_LAUNCH == DecodeLaunch(block_n=BLOCK_N, num_warps=4, num_stages=2, split_waves=2.0, max_splits=16)
    assert launch_config(True, True) == DecodeLaunch(FP8_BLOCK_N, 4, 1, 2.0, 16, 128)
    assert launch_config(True, False) == DecodeLaunch(BLOCK_N, 4, 1, 2.0, 16, 128)
    assert launch_config(False, False) == BF16_LAUNCH
    with tuning.override(kv_decode_block_n=32, kv_decode_num_warps=8, kv_decode_num_stages=3,
                         kv_decode_split_waves=0.5, kv_decode_max_splits=4):
        assert launch_config(True, True) == DecodeLaunch(32, 8, 3, 0.5, 4, 128) == launch_config(True, False)
        assert launch_config(False, False) == BF16_LAUNCH
    # the fields take the command line's types (bench/common.parse_tuning reads a value as the default's type)
    assert {f: type(getattr(tuning.current(), f)) for f in FIELDS} == {
        "kv_decode_block_n": int, "kv_decode_num_warps": int, "kv_decode_num_stages": int,
        "kv_decode_split_waves": float, "kv_decode_max_splits": int}


def test_split_policy():
    """``ceil(waves * SMs / (seqs * KV heads))`` splits, at most ``max_splits`` and the longest context's tiles (the
    CPU's stand-in SM count is 4)."""
    from jetrl.quant.kernels.paged_attention_triton import choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(1, 2, 1000, cpu, 16) == 4  # ceil(2 * 4 / 2)
    assert choose_num_splits(1, 2, 1000, cpu, 16, waves=8.0) == 16
    assert choose_num_splits(1, 2, 1000, cpu, 16, waves=32.0) == 16  # the default cap
    assert choose_num_splits(1, 2, 1000, cpu, 16, waves=32.0, max_splits=40) == 40
    assert choose_num_splits(1, 2, 100, cpu, 16, waves=32.0, max_splits=40) == 7  # 7 tiles of 16
    assert choose_num_splits(3, 2, 1000, cpu, 16, waves=0.25) == 1
    assert choose_num_splits(3, 2, 1000, cpu, 16, waves=1.5) == 1  # ceil(6 / 6)
    assert choose_num_splits(3, 2, 1000, cpu, 16, waves=1.75) == 2  # ceil(7 / 6)
    for seqs in (1, 3, 5, 64, 256):  # the default is today's two waves, integer arithmetic
        for ctx in (1, 100, 5000):
            assert choose_num_splits(seqs, 8, ctx, cpu, 128) == max(1, min(-(-8 // (seqs * 8)), 16, -(-ctx // 128)))


# ------------------------------------------------------------------------------------------------------------
# CPU: a grid of configs under the Triton interpreter, in a child

# (settings, the splits they give for 3 sequences x 2 KV heads with contexts up to 130 on the CPU's 4 "SMs")
GRID = [
    ({"kv_decode_block_n": 16}, 2),  # ceil(8 / 6); 9 tiles of 16 per sequence, split in 2
    ({"kv_decode_block_n": 32, "kv_decode_split_waves": 8.0, "kv_decode_num_warps": 8, "kv_decode_num_stages": 3},
     5),  # ceil(32 / 6) = 6, capped by the 5 tiles of 32
    ({"kv_decode_block_n": 64, "kv_decode_split_waves": 0.25}, 1),
    ({"kv_decode_block_n": 16, "kv_decode_split_waves": 32.0, "kv_decode_max_splits": 3}, 3),
    ({"kv_decode_block_n": 256, "kv_decode_num_warps": 2}, 1),  # one tile holds the longest context
]

_CHILD = r'''
import json, sys
import torch
from jetrl.models.attention import paged_attention_reference
from jetrl.quant import reference as R
from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.paged_attention_triton import choose_num_splits, launch_config, paged_decode
''' + "\n".join(inspect.getsource(f) for f in _SHARED) + f"\nGRID = {[settings for settings, _ in GRID]!r}\n" + r'''
out = {}
g = torch.Generator().manual_seed(0)
contexts, page, hq, hkv, d = [1, 37, 130], 8, 6, 2, 32  # a one-token context, partial pages, GQA group 3
meta, kd, ks, vd, vs = paged_case(g, contexts, [1] * len(contexts), page, hkv, d, shared_blocks=1)
for dtype, factored in ((torch.float32, True), (torch.float16, False)):  # both routes; the interpreter is slow
    q = torch.randn(len(contexts), hq, d, generator=g).to(dtype)
    kq, vq = dequantize_kv_ref(kd, ks, dtype), dequantize_kv_ref(vd, vs, dtype)
    ref = paged_attention_reference(q.float(), kq.float(), vq.float(), meta, d ** -0.5)
    for i, settings in enumerate(GRID):
        with tuning.override(kv_decode_factored=factored, **settings):
            launch = launch_config(True, factored)
            splits = choose_num_splits(len(contexts), hkv, meta.max_context_len, q.device, launch.block_n,
                                       launch.split_waves, launch.max_splits)
            a = paged_decode(q, kd, vd, meta, d ** -0.5, ks, vs)
        b = paged_decode(q, kq, vq, meta, d ** -0.5, num_splits=splits, block_n=launch.block_n)
        bitwise = same_bits_but_subnormal(a, b) if factored else same_bits(a, b)
        out[f"{str(dtype)[6:]}-{'factored' if factored else 'inreg'}-{i}"] = {
            "err": rel_err(a, ref), "bitwise": bitwise, "splits": splits, "block_n": launch.block_n}
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "decode-attention configs", timeout=600)


def test_every_config_attends_like_the_reference(interpreted):
    assert len(interpreted) == 2 * len(GRID), sorted(interpreted)
    for name, r in interpreted.items():
        settings, splits = GRID[int(name.rsplit("-", 1)[1])]
        assert r["splits"] == splits and r["block_n"] == settings["kv_decode_block_n"], (name, r)
        assert r["err"] < TOL[name.split("-")[0]], (name, r)
        # the FP8 kernel at a config is the kernel over the dequantized cache at that tile and split
        assert r["bitwise"], (name, r)


# ------------------------------------------------------------------------------------------------------------
# GPU: configs at the Llama-3.1-8B head shapes (warps and stages matter here), both routes, split and unsplit

GPU_GRID = [
    {"kv_decode_block_n": 64, "kv_decode_num_stages": 3, "kv_decode_split_waves": 8.0},
    {"kv_decode_block_n": 128, "kv_decode_num_warps": 8, "kv_decode_split_waves": 32.0},
    {"kv_decode_block_n": 256, "kv_decode_num_stages": 1},
    {"kv_decode_block_n": 32, "kv_decode_num_warps": 2, "kv_decode_max_splits": 4, "kv_decode_split_waves": 16.0},
]


@pytest.mark.gpu
@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("num_seqs", [5, 64])
def test_paged_decode_fp8_configs_at_8b_shapes(num_seqs, factored):
    from jetrl.models.attention import paged_attention_reference
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    q, meta, kd, ks, vd, vs = _decode_case(num_seqs)
    kq, vq = kd.float() * ks[..., None], vd.float() * vs[..., None]
    ref = paged_attention_reference(q.float(), kq, vq, meta, q.shape[-1] ** -0.5)
    for settings in GPU_GRID:
        with tuning.override(kv_decode_factored=factored, kv_decode_streams=False, **settings):
            a = paged_decode(q, kd, vd, meta, q.shape[-1] ** -0.5, ks, vs)
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all(), settings
        assert rel_err(a, ref) < 1e-2, (settings, rel_err(a, ref))
