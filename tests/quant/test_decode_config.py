"""Default configs of the split-K decode GEMM: the per-M policies, the measured per-shape entries, validation.

Pure host logic (no kernel runs); the kernels themselves are checked under the interpreter and on the GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from jetrl.quant.kernels import gemm_decode_triton as dk  # noqa: E402
from jetrl.quant.kernels import tuning  # noqa: E402

DEFAULTS = tuning.current()

CPU = torch.device("cpu")  # 132 SMs assumed off the GPU, as on the H200


def test_policies_cover_every_row_count_in_order():
    bounds = [p.max_m for p in DEFAULTS.decode_policies]
    assert bounds == sorted(bounds) and bounds[-1] == dk.DECODE_GEMM_MAX_M
    for m in (1, 32, 33, 64, 65, 128, 129, 256):
        assert DEFAULTS.decode_policy(m).max_m == min(b for b in bounds if b >= m)


def test_policy_splits_fill_the_gpu():
    # M <= 32, 4096-wide output: 64 column tiles, three programs per SM wanted -> split 8 (rounded up)
    cfg = dk.default_decode_config(8, 1024 + 4096 + 7, 4096, CPU)
    tiles = -(-(1024 + 4096 + 7) // cfg.block_n)
    assert cfg.block_n == 64 and tiles * cfg.split_k >= 3 * 132 > tiles * cfg.split_k // 2
    # M = 129-256: 128 x 128 tiles with TMA, about one program per SM rounded down
    cfg = dk.default_decode_config(200, 4096, 4096, CPU)
    assert (cfg.block_n, cfg.block_m, cfg.tma, cfg.num_warps) == (128, 128, True, 8)
    assert (4096 // 128) * 2 * cfg.split_k <= 132


@pytest.mark.parametrize("m,bucket", [(1, 32), (16, 32), (32, 32), (33, 64), (64, 64), (65, 128), (128, 128),
                                      (129, 256), (256, 256)])
def test_measured_shape_entries_win_within_their_bucket(m, bucket):
    for (b, n, k, grouped), cfg in DEFAULTS.decode_shape_configs.items():
        got = dk.default_decode_config(m, n, k, CPU, grouped=grouped)
        assert (got == cfg) == (b == bucket), (m, n, k, grouped)


def test_grouped_and_single_launches_are_looked_up_apart():
    single = dk.default_decode_config(32, 28672, 4096, CPU)
    grouped = dk.default_decode_config(32, 28672, 4096, CPU, grouped=True)
    assert single == DEFAULTS.decode_shape_configs[(32, 28672, 4096, False)]
    assert grouped == DEFAULTS.decode_policy(32).config(32, 28672, 4096, 132) != single
    # beyond M = 64 only the policies apply to shapes without a measured entry there
    assert dk.default_decode_config(65, 4096, 14336, CPU) == DEFAULTS.decode_policy(65).config(65, 4096, 14336, 132)


@pytest.mark.parametrize("bad", [dict(block_n=48), dict(block_n=512), dict(block_m=8), dict(k_unroll=3),
                                 dict(split_k=0), dict(num_warps=3), dict(num_stages=0)])
def test_bad_configs_get_clear_errors(bad):
    with pytest.raises(ValueError, match="DecodeGemmConfig"):
        dk.DecodeGemmConfig(**bad)


def test_decode_routing_reads_the_per_shape_bounds():
    """The measured per-shape bounds replace the general ones; other shapes keep the general bounds."""
    for key, bound in DEFAULTS.decode_max_m_by_shape.items():
        grouped = key[0] == "grouped"
        n, k = key[1:] if grouped else key
        assert DEFAULTS.decode_rows(n, k, grouped=grouped) == min(bound, dk.DECODE_GEMM_MAX_M)
    assert DEFAULTS.decode_rows(1536, 1536) == DEFAULTS.decode_max_m  # o of the 1.5B shape: cuBLAS past 64
    assert DEFAULTS.decode_rows(17920, 1536, grouped=True) == DEFAULTS.grouped_decode_max_m
    with tuning.override(decode_max_m=16, decode_max_m_by_shape={}) as knobs:
        assert knobs.decode_rows(1536, 8960) == 16


def test_decode_tables_are_frozen():
    with pytest.raises(TypeError):
        DEFAULTS.decode_shape_configs[(32, 1, 1, False)] = dk.DecodeGemmConfig()
    with pytest.raises(TypeError):
        DEFAULTS.decode_max_m_by_shape[(1, 1)] = 1


def test_tuned_policies_reach_the_default_config():
    policies = (tuning.DecodePolicy(max_m=dk.DECODE_GEMM_MAX_M, block_n=32, programs_per_sm=1.0),)
    with tuning.override(decode_policies=policies, decode_shape_configs={}):
        assert dk.default_decode_config(64, 28672, 4096, CPU).block_n == 32
    assert dk.default_decode_config(64, 28672, 4096, CPU) == DEFAULTS.decode_shape_configs[(64, 28672, 4096, False)]
