"""bench/decode_profile.py on CPU: the kernel classification on real kernel names, the per-step GPU arithmetic (busy,
gaps, period, the LM head's position) on synthetic intervals, the trace parsing on synthetic kineto events, the shapes
and command line, and an end-to-end run at the tiny shape (no CUDA kernels: the GPU columns are 0)."""

import json
import math

import pytest

from bench import decode_profile as dp
from bench.decode_profile import GpuOp


@pytest.mark.parametrize("name, category", [
    # cuBLAS / cuBLASLt / CUTLASS / DeepGEMM and jetrl's Triton GEMMs
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GemmShape<128, 128, 64>>>",
     "gemm"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_TNN", "gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, false>", "gemm"),
    ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 2048u, 7168u, 128u>", "gemm"),
    ("_fp8_decode_gemm_kernel", "gemm"),
    ("_blockwise_fp8_gemm_kernel", "gemm"),
    ("_exact_gemm_kernel", "gemm"),
    ("_exact_gemm_tma_kernel", "gemm"),
    ("_exact_reduce_kernel", "gemm"),  # the exact GEMM's split-K sum, not a norm
    ("_add_bias_kernel", "gemm"),  # a linear's bias epilogue
    # attention: jetrl's Triton/Gluon paged decode kernels, exact mode's, FlashAttention, cuDNN
    ("_paged_decode_kernel", "attention"),
    ("_paged_decode_streams_kernel", "attention"),
    ("merge_splits_kernel", "attention"),
    ("_exact_attention_tiles_kernel", "attention"),
    ("_exact_decode_kernel", "attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwd"
     "Sm90<2, cute::tuple<cute::C<1>>>>>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    # quantization (Triton and the Gluon 128x1 kernels)
    ("_quantize_act_1x128_kernel", "quantize"),
    ("_quantize_rows_cols_kernel", "quantize"),
    ("_requantize_act_to_token_kernel", "quantize"),
    ("token_kernel", "quantize"),
    ("act_and_token_kernel", "quantize"),
    # the paged KV-cache store: FP8 (Triton) and BF16 (index_copy_)
    ("_quantize_scatter_kv_kernel", "kv_write"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_copy_kernel"
     "_impl<c10::BFloat16>(at::TensorIterator&, long, long, long)::{lambda(char*, char*, long)#1}>>", "kv_write"),
    ("_rms_norm_fwd_kernel", "norm"),
    ("_rope_qk_kernel", "rope"),
    ("_swiglu_fwd_kernel", "swiglu/act"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>",
     "swiglu/act"),
    # sampling
    ("_seeded_gumbel_sample_kernel", "sampling"),
    ("_logprob_stats_kernel", "sampling"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxForwardEpilogue>", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
     "long, 4>>", "sampling"),
    ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
     "at::native::templates::cuda::uniform_and_transform<float, float, 4>>", "sampling"),
    # copies, fills, CUPTI's memcpy/memset records
    ("Memcpy HtoD (Pinned -> Device)", "copy/memset"),
    ("Memcpy DtoH (Device -> Pinned)", "copy/memset"),
    ("Memset (Device)", "copy/memset"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>>", "copy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul>>",
     "copy/memset"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_put_kernel_impl"
     "<at::native::OpaqueType<8>>>>", "copy/memset"),
    # the rest
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul>>", "other"),
    ("triton_poi_fused_add_0", "other"),
])
def test_kernel_categories(name, category):
    assert dp.classify_kernel(name) == category


def test_every_name_category_is_reported():
    reported = set(dp.CATEGORIES)
    assert {c for c, _ in dp.NAME_RULES} - {"sampling"} <= reported and "lm_head+sampling" in reported
    assert set(dp.SHORT) == reported


def test_union_length_counts_overlaps_once():
    assert dp.union_length([]) == 0.0
    assert dp.union_length([(0, 10), (5, 15), (20, 30)]) == 25.0
    assert dp.union_length([(20, 30), (0, 10), (10, 12)]) == 22.0  # touching intervals, any order
    assert dp.union_length([(0, 10), (2, 3), (4, 9)]) == 10.0  # nested
    assert dp.union_length([(5, 5), (7, 6)]) == 0.0  # empty and reversed add nothing


def test_gpu_step_stats_busy_gaps_and_period():
    ops = {
        10: [GpuOp("a", 0, 10), GpuOp("b", 5, 15), GpuOp("c", 20, 30)],  # overlap (PDL) and a 5 us hole
        11: [GpuOp("d", 40, 50), GpuOp("e", 50, 55)],  # starts 10 us after step 10's last end
    }
    s10, s11, s12 = dp.gpu_step_stats(ops, [10, 11, 12])
    assert (s10.busy, s10.span, s10.inside_gap) == (25, 30, 5)
    assert s10.period == 40 and s10.idle == 15 and s10.wait_before == 0  # no step 9 traced
    assert s10.kernel_time == 30 and s10.ops == 3  # summed durations count the overlap twice
    assert (s11.busy, s11.span, s11.inside_gap, s11.wait_before) == (15, 15, 0, 10)
    assert s11.period == 15 and s11.idle == 0  # no step 12: the period is the span
    assert s12.busy == s12.period == s12.kernel_time == 0 and s12.ops == 0
    assert sum(s10.categories.values()) == s10.kernel_time and set(s10.categories) == set(dp.CATEGORIES)


def _decode_step_ops(lm_head: str = "nvjet_tst_256x128_64x4_2x1_v_bz_TNN") -> list[GpuOp]:
    """A decode step as the trace shows it: the inputs' copies, the graph's kernels (one block), the eager sampler."""
    names = [
        ("Memcpy HtoD (Pinned -> Device)", "memcpy"), ("index_put_kernel_impl", "kernel"),
        ("_rms_norm_fwd_kernel", "kernel"), ("_quantize_act_1x128_kernel", "kernel"),
        ("_fp8_decode_gemm_kernel", "kernel"), ("_rope_qk_kernel", "kernel"), ("_quantize_scatter_kv_kernel", "kernel"),
        ("_paged_decode_streams_kernel", "kernel"), ("merge_splits_kernel", "kernel"),
        ("_fp8_decode_gemm_kernel", "kernel"), ("_rms_norm_fwd_kernel", "kernel"),
        ("_fp8_decode_gemm_kernel", "kernel"),
        ("_swiglu_fwd_kernel", "kernel"), ("_fp8_decode_gemm_kernel", "kernel"), ("_rms_norm_fwd_kernel", "kernel"),
        (lm_head, "kernel"),
        ("elementwise_kernel<direct_copy_kernel_cuda>", "kernel"),  # the logits' .float()
        ("distribution_elementwise_grid_stride_kernel<uniform>", "kernel"),
        ("vectorized_elementwise_kernel<log_kernel_cuda>", "kernel"), ("reduce_kernel<ArgMaxOps>", "kernel"),
        ("CatArrayBatchedCopy", "kernel"),  # torch.stack of tokens and log-probs
        ("Memcpy DtoH (Device -> Pinned)", "memcpy"),
    ]
    return [GpuOp(n, 10.0 * i, 10.0 * i + 1 + i, kind) for i, (n, kind) in enumerate(names)]  # op i lasts 1 + i us


def test_step_categories_find_the_lm_head_by_position():
    ops = _decode_step_ops()
    dur = {i: 1.0 + i for i in range(len(ops))}
    cats = dp.step_categories(list(reversed(ops)))  # any input order: sorted by start
    assert cats["copy/memset"] == dur[0] + dur[1] + dur[21]  # H2D, the placeholder index_put, the D2H copy
    assert cats["norm"] == dur[2] + dur[10] + dur[14]
    assert cats["quantize"] == dur[3]
    assert cats["gemm"] == dur[4] + dur[9] + dur[11] + dur[13]  # the blocks' GEMMs, not the LM head's
    assert cats["rope"] == dur[5] and cats["kv_write"] == dur[6] and cats["swiglu/act"] == dur[12]
    assert cats["attention"] == dur[7] + dur[8]
    assert cats["lm_head+sampling"] == sum(dur[i] for i in range(15, 21))  # LM head .. stack, copies included
    assert cats["other"] == 0
    assert math.isclose(sum(cats.values()), sum(op.duration for op in ops))
    # a split-K LM head: both kernels of the last GEMM run are the head's
    split = _decode_step_ops()
    split.insert(16, GpuOp("void cublasLt::splitKreduce_kernel<32, 16>", 155.5, 155.9))
    assert dp.step_categories(split)["gemm"] == cats["gemm"]
    # no GEMM in the step: sampling kernels still count as sampling, the rest by name
    cats = dp.step_categories([GpuOp("_seeded_gumbel_sample_kernel", 0, 2), GpuOp("CatArrayBatchedCopy", 3, 4)])
    assert cats["lm_head+sampling"] == 2 and cats["copy/memset"] == 1


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_parse_trace_assigns_gpu_work_to_the_launch_that_enqueued_it():
    mark = dp.STEP_MARK
    events = [
        {"ph": "M", "name": "process_name", "pid": 1},  # metadata, skipped
        _x("user_annotation", f"{mark}5", 100, 100),
        _x("user_annotation", dp.COLLECT_MARK, 210, 50),
        _x("user_annotation", f"{mark}6", 300, 100),
        _x("gpu_user_annotation", f"{mark}5", 900, 100, tid=7),  # the GPU-side range of the same name: not a launch
        _x("cuda_runtime", "cudaMemcpyAsync", 120, 5, correlation=1),
        _x("cuda_runtime", "cudaGraphLaunch", 150, 20, correlation=2),
        _x("cuda_driver", "cuLaunchKernel", 199, 1, correlation=3),
        _x("cuda_runtime", "cudaEventSynchronize", 220, 30, correlation=4),  # in the collect: enqueues nothing
        _x("cuda_runtime", "cudaGraphLaunch", 350, 20, correlation=5),
        _x("cuda_runtime", "cudaLaunchKernel", 50, 5, correlation=6),  # before any marked launch
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 400, 2, tid=7, correlation=1),
        _x("kernel", "_rms_norm_fwd_kernel", 410, 3, tid=7, correlation=2),  # one graph replay, two kernels
        _x("kernel", "_fp8_decode_gemm_kernel", 413, 6, tid=7, correlation=2),
        _x("kernel", "_seeded_gumbel_sample_kernel", 420, 2, tid=7, correlation=3),
        _x("kernel", "_rms_norm_fwd_kernel", 500, 3, tid=7, correlation=5),
        _x("gpu_memset", "Memset (Device)", 510, 1, tid=7, correlation=5),
        _x("kernel", "left_over_kernel", 90, 3, tid=7, correlation=6),  # enqueued before the profiled launches
        _x("kernel", "no_call_kernel", 95, 3, tid=7, correlation=99),
        _x("user_annotation", dp.PREFILL_MARK, 600, 50),  # a prefill launch after step 6: its work is no step's
        _x("cuda_runtime", "cudaLaunchKernel", 610, 5, correlation=7),
        _x("kernel", "prefill_kernel", 700, 3, tid=7, correlation=7),
    ]
    trace = dp.parse_trace(events)
    assert trace.launches == {5: (100.0, 200.0), 6: (300.0, 400.0)} and trace.threads == {5: 1, 6: 1}
    assert [(op.name, op.kind) for op in trace.ops_by_step[5]] == [
        ("Memcpy HtoD (Pinned -> Device)", "memcpy"), ("_rms_norm_fwd_kernel", "kernel"),
        ("_fp8_decode_gemm_kernel", "kernel"), ("_seeded_gumbel_sample_kernel", "kernel")]
    assert [op.kind for op in trace.ops_by_step[6]] == ["kernel", "memset"]
    assert trace.unattributed == 3
    s5, = dp.gpu_step_stats(trace.ops_by_step, [5])
    assert (s5.busy, s5.span, s5.period) == (13.0, 22.0, 100.0)


def test_host_calls_counts_top_level_events_inside_the_launches():
    events = [
        _x("cpu_op", "aten::to", 110, 40),
        _x("cpu_op", "aten::copy_", 120, 10),  # nested in aten::to
        _x("cpu_op", "aten::index_put", 160, 10),
        _x("cpu_op", "aten::to", 180, 5),
        _x("cpu_op", "aten::mul", 250, 10),  # outside every launch
        _x("cpu_op", "aten::add", 120, 10, tid=2),  # another thread than the launch's
        _x("cuda_runtime", "cudaGraphLaunch", 170, 5),
    ]
    ops = dp.host_calls(events, [(100.0, 200.0, 1), (300.0, 400.0, 1)], ("cpu_op",))
    assert ops == {"aten::to": (45.0, 2), "aten::index_put": (10.0, 1)}
    assert dp.host_calls(events, [(100.0, 200.0, 1)], ("cuda_runtime",)) == {"cudaGraphLaunch": (5.0, 1)}


def test_shapes():
    from bench.common import MODEL_SHAPES, QWEN2_15B, QWEN25_05B, QWEN25_7B
    from bench.rl_step import parameter_counts

    assert parameter_counts(QWEN25_05B)[0] == 494_032_768  # Qwen2.5-0.5B as published
    assert parameter_counts(QWEN25_7B)[0] == 7_615_616_512  # Qwen2.5-7B as published
    assert parameter_counts(QWEN2_15B)[0] == 1_543_714_304  # Qwen2-1.5B as published
    assert MODEL_SHAPES["0.5b"]["hidden_size"] // MODEL_SHAPES["0.5b"]["num_attention_heads"] == 64
    shapes = dp.parse_shapes("0.5b,7b:8,8b", None)
    assert [(label, s["num_hidden_layers"]) for label, s in shapes] == [("0.5b", 24), ("7b:8", 8), ("8b", 32)]
    assert shapes[1][1]["hidden_size"] == 3584 and MODEL_SHAPES["7b"]["num_hidden_layers"] == 28  # not modified
    assert [label for label, _ in dp.parse_shapes("0.5b,7b:28,1.5b:2", 4)] == ["0.5b:4", "7b", "1.5b:2"]
    for bad in ("70b", "7b:0", "7b:29", "7b:x", ","):
        with pytest.raises(ValueError):
            dp.parse_shapes(bad, None)


def test_rollout_bench_takes_the_shared_shapes():
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_rollout_shapes", root / "bench" / "rollout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        from bench.common import MODEL_SHAPES

        assert all(module.SHAPES[name] is MODEL_SHAPES[name] for name in module.SHAPES)
        assert {s: list(v) for s, v in module._parse(["--shape", "0.5b,7b"]).shapes.items()} == {
            "0.5b": ["b64", "b256"], "7b": ["b64", "b256"]}
    finally:
        sys.modules.pop(spec.name, None)


def test_command_line():
    args = dp._parse([])
    assert [a.name for a in args.arms] == ["bf16", "jet", "jet+kv8"] and args.batches == [64, 256]
    assert [label for label, _ in args.shapes] == ["0.5b", "1.5b", "8b"]
    assert (args.prompt_len, args.new_tokens, args.start, args.steps) == (256, 1024, 100, 20)
    assert args.trace_dir is None and not args.whole
    for bad in (["--start", "5"], ["--start", "1010"], ["--steps", "0"], ["--shape", "70b"], ["--batches", "0"],
                ["--batches", "x"], ["--blocks", "0"], ["--arms", "bf16+kv8"], ["--memory-budget", "2"]):
        with pytest.raises(SystemExit):
            dp._parse(bad)


def test_registered_as_a_benchmark():
    from jetrl.bench_scripts import available_benches

    assert "decode_profile" in available_benches()


TINY = ["--device", "cpu", "--shape", "tiny", "--batches", "3", "--prompt-len", "8", "--new-tokens", "24",
        "--start", "7", "--steps", "3", "--profile-warmup", "2", "--warmup-tokens", "2"]


def test_tiny_run_end_to_end(one_thread, tmp_path, capsys):
    path = tmp_path / "out" / "decode_profile.json"
    results = dp.main(TINY + ["--json", str(path), "--trace-dir", str(tmp_path / "traces")])
    assert [(r.shape, r.batch, r.arm) for r in results] == [("tiny", 3, "bf16"), ("tiny", 3, "jet"),
                                                            ("tiny", 3, "jet+kv8")]
    for r in results:
        assert not r.gpu and r.generated_tokens == 7 + 3 + 3 and r.mean_context == 8 + 7 + 2
        assert r.ms_per_step > 0 and r.decode_tokens_per_s == pytest.approx(3 / (r.ms_per_step / 1e3))
        assert 0 < r.launch_ms <= r.ms_per_step and r.host_ms <= r.ms_per_step + 1e-9
        assert r.ms_per_step_profiled > 0 and r.host_ms_profiled > 0
        assert r.gpu_busy_ms == r.gap_ms == r.kernel_ms == r.gpu_period_ms == 0 and r.unattributed_gpu_ops == 0
        assert set(r.category_share) == set(dp.CATEGORIES) and not any(r.category_share.values())
        assert r.host_ops and all(calls > 0 for _, _, calls in r.host_ops)  # the forward's operators, on CPU
        assert r.step_bytes > 0 and r.roofline_share > 0 and math.isfinite(r.roofline_share)
        trace = dp.parse_trace(json.load(open(r.trace))["traceEvents"])
        assert set(trace.launches) == set(range(7 - 2, 7 + 3 + 1))  # warm-up steps .. the one after the window
    assert results[2].step_bytes < results[1].step_bytes < results[0].step_bytes  # FP8 weights, then FP8 KV
    report = json.loads(path.read_text())
    assert [r["arm"] for r in report["results"]] == ["bf16", "jet", "jet+kv8"] and not report["skipped"]
    assert report["categories"] == list(dp.CATEGORIES) and report["args"]["shapes"] == ["tiny"]
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-4].split()[:5] == ["shape", "batch", "arm", "tok/s", "ms/step"]  # the table comes last
    assert all("no GPU" in line for line in lines[-3:])


def test_tiny_run_within_its_time_cap_skips_the_rest(one_thread, capsys):
    results = dp.main(TINY + ["--arms", "bf16", "--batches", "2,3", "--max-seconds", "0.001"])
    assert results == [] and capsys.readouterr().out.count("skipped") >= 1
