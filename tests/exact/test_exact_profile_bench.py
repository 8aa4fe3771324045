"""bench/profile_step.py's exact-mode arm on CPU: its kernel classifier knows exact mode's Triton kernels, and the
``--tiny`` smoke run profiles fast and exact ``jet`` (the scoring forward and the update's forward+backward as the
trainer runs them) and sets them side by side."""

from __future__ import annotations

import json

import pytest
import torch

from bench import profile_step


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()  # tiny matrices: more threads only contend on a busy machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name, kind", [
    ("_exact_gemm_kernel", "exact gemm"),
    ("_exact_reduce_kernel", "exact gemm"),  # the split-K sum, not a norm's reduction
    ("_exact_attention_kernel", "exact attention"),
    ("_exact_decode_kernel", "exact attention"),  # the swapped decode schedule
    ("_exact_gemm_tma_kernel", "exact gemm"),
    ("_logprob_stats_kernel", "lm-head logprobs"),
    ("void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, (anonymous namespace)::"
     "LogSoftMaxForwardEpilogue>", "lm-head logprobs"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128>>",
     "attention"),
    ("_paged_decode_kernel", "attention"),
    ("_blockwise_fp8_gemm_kernel", "gemm"),
    ("_quantize_rows_cols_kernel", "fp8 quant"),
])
def test_exact_kernel_kinds(name, kind):
    assert profile_step.kind_of(name) == kind


def test_tiny_exact_profile(tmp_path, capsys):
    path = tmp_path / "profile.json"
    arms = "jet,jet-exact,jet-exact@exact_split_k=1"
    results = profile_step.main(["--tiny", "--exact", "--arms", arms, "--steps", "1", "--top", "3",
                                 "--json", str(path)])
    names = ["jet", "jet-exact", "jet-exact@exact_split_k=1"]
    assert set(results) == {f"{a}/{p}" for a in names for p in ("score", "update")}
    for res in results.values():
        assert res["total_us"] > 0 and res["kernels"] > 0 and res["wall_ms"] > 0
        assert abs(sum(t for t, _ in res["by_kind"].values()) - res["total_us"]) <= 1e-6 * res["total_us"]
    for arm in names:  # the scoring pass split into the decoder blocks and the LM head
        assert results[f"{arm}/score"]["blocks_wall_ms"] > 0 and results[f"{arm}/score"]["head_wall_ms"] > 0
    # the update runs a backward: more operators than the scoring forward alone
    assert results["jet-exact/update"]["kernels"] > results["jet-exact/score"]["kernels"]
    out = capsys.readouterr().out
    for part in ("score", "update"):
        table = out[out.index(f"== {part}: arms side by side"):]
        assert "[2] jet-exact@exact_split_k=1" in table
        assert "[1] over [0]: kernel sum" in table and "[2] over [0]: kernel sum" in table
    assert set(json.loads(path.read_text())) == set(results)


def test_bad_part_is_a_usage_error():
    with pytest.raises(SystemExit):
        profile_step.main(["--tiny", "--parts", "score,backward"])
