"""The kernel seam (jetrl.quant.backend): which implementation runs each op, and the tuning object.

CPU: the reference backend resolves every fused op to the reference, implements every operation of the
backend protocol from its basic ones (bitwise), and the model and rollout code ask the seam (forcing the
kernels on CPU without the interpreter is refused there). GPU: with the reference backend selected, a whole
``jet`` RL step launches no Triton or Gluon kernel and no cuBLAS blockwise GEMM.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from jetrl.quant import ACT, TOKEN, WEIGHT, FP8Linear, fused_impl, get_backend, use_backend
from jetrl.quant import backend as seam
from jetrl.quant import reference as R
from jetrl.quant.kernels import tuning


def _protocol_ops() -> list[str]:
    return [name for name, _ in inspect.getmembers(seam.Fp8Backend, inspect.isfunction) if not name.startswith("_")]


def test_reference_backend_resolves_every_op_to_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 8)
    with use_backend("reference"):
        backend = get_backend(x.device)
        assert backend.name == "reference" and backend.fused_kernels is False
        for op in seam.FUSED_OPS:
            assert seam.choose_impl(x, None, op=op) == "reference"
            with fused_impl("reference"):
                assert seam.choose_impl(x, None, op=op) == "reference"
            with fused_impl("triton"), pytest.raises(ValueError, match=f"{op}: impl='triton' needs CUDA"):
                seam.choose_impl(x, None, op=op)
    assert get_backend("cpu").name == "reference"  # automatic choice off the GPU
    with pytest.raises(ValueError, match="op must be one of"):
        seam.choose_impl(x, None, op="layer_norm")
    with pytest.raises(ValueError, match="impl must be one of"):
        seam.choose_impl(x, "cutlass", op="rope")


def test_reference_backend_implements_the_whole_protocol_bitwise(gen):
    ops = _protocol_ops()
    assert {"quantize", "requantize", "gemm", "quantize_weight_pair", "transpose_weight", "quantize_act_and_token",
            "grouped_gemm"} <= set(ops)
    backend = seam.ReferenceBackend()
    for name in ops:
        assert callable(getattr(backend, name)), name
    w = torch.randn(300, 260, generator=gen)
    q, qt = backend.quantize_weight_pair(w, pow2_scale=True)
    ref = R.quantize_tensor(w, WEIGHT, True)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
    assert qt.data.is_contiguous() and torch.equal(qt.data.view(torch.uint8), ref.data.t().view(torch.uint8))
    assert torch.equal(qt.scale, ref.scale.t()) and qt.block == WEIGHT
    again = backend.transpose_weight(q)  # W^T from W's FP8 form: the pair's second result
    assert torch.equal(again.data.view(torch.uint8), qt.data.view(torch.uint8)) and torch.equal(again.scale, qt.scale)
    act, tok = backend.quantize_act_and_token(w)
    for got, block in ((act, ACT), (tok, TOKEN)):
        ref = R.quantize_tensor(w, block)
        assert got.block == block and torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(got.scale, ref.scale)
    a = R.quantize_tensor(torch.randn(5, 256, generator=gen), ACT)
    weights = [R.quantize_tensor(torch.randn(n, 256, generator=gen), WEIGHT) for n in (128, 64, 64)]
    for biases in ([None] * 3, [torch.randn(n, generator=gen) for n in (128, 64, 64)]):
        out = backend.grouped_gemm(a, weights, biases, out_dtype=torch.float32)
        one = [R.gemm(a, wq, torch.float32) for wq in weights]
        one = [y + b if b is not None else y for y, b in zip(one, biases)]
        assert torch.equal(out, torch.cat(one, dim=1))


def test_rollout_and_model_ops_ask_the_seam(monkeypatch, gen):
    """The sampler and paged attention take their kernels through the seam: forcing them on CPU without the
    interpreter is refused by it, and the automatic choice on CPU is the reference."""
    from jetrl.models import PagedAttentionMetadata, paged_attention, paged_attention_reference
    from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.randn(3, 50, generator=gen)
    batch = SamplingBatch.build([SamplingParams(seed=5)] * 3, [0, 1, 2], [0, 0, 0], "cpu")
    tok, lp = sample(logits, batch)
    assert torch.equal(tok, sample(logits, batch, impl="reference")[0])
    with fused_impl("triton"), pytest.raises(ValueError, match="seeded_sample: impl='triton' needs CUDA"):
        sample(logits, batch)
    k = torch.randn(4, 4, 2, 8, generator=gen)
    v = torch.randn(4, 4, 2, 8, generator=gen)
    meta = PagedAttentionMetadata(torch.arange(3, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32),
                                  torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
                                  torch.tensor([2, 12], dtype=torch.long), 1, 5)
    q = torch.randn(2, 4, 8, generator=gen)
    assert torch.equal(paged_attention(q, k, v, meta, 0.3), paged_attention_reference(q, k, v, meta, 0.3))
    with pytest.raises(ValueError, match="paged_decode: impl='triton' needs CUDA"):
        paged_attention(q, k, v, meta, 0.3, impl="triton")


def test_tuning_override_nests_restores_and_rejects_unknown_settings():
    base = tuning.current()
    with tuning.override(kv_decode_block_n=64) as outer:
        assert outer.kv_decode_block_n == 64 and tuning.current() is outer
        with tuning.override(gluon=False):
            assert tuning.current().kv_decode_block_n == 64 and tuning.current().gluon is False
        assert tuning.current().gluon is base.gluon
    assert tuning.current() is base
    with pytest.raises(TypeError, match="unknown setting"):
        with tuning.override(TOKEN_KERNEL="gluon"):
            pass
    with pytest.raises(ValueError, match="must be one of"):
        tuning.KernelTuning(gemm="cutlass")
    with pytest.raises(ValueError, match="power of two"):
        tuning.KernelTuning(kv_decode_num_warps=3)
    with pytest.raises(Exception):  # frozen
        base.gluon = False  # type: ignore[misc]


def _tuning_in_child(env_value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JETRL_FP8_GEMM=env_value)
    code = "from jetrl.quant.kernels import tuning; print(tuning.current().gemm)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_jetrl_fp8_gemm_is_read_once_into_the_tuning_object():
    done = _tuning_in_child("triton")
    assert done.returncode == 0 and done.stdout.strip() == "triton", done.stderr
    done = _tuning_in_child("fastest")
    assert done.returncode != 0 and "JETRL_FP8_GEMM" in done.stderr


def test_importing_the_seam_imports_no_kernel_module():
    code = ("import sys, jetrl.quant, jetrl.models, jetrl.rollout; "
            "print(sorted(m for m in sys.modules if m.startswith('jetrl.quant.kernels.') and m != "
            "'jetrl.quant.kernels.tuning' or m == 'triton'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


# --------------------------------------------------------------------------------------------------- GPU

MODEL = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1)


class _Prompts:
    def next_batch(self):
        from jetrl.rl.trainer import PromptItem

        return [PromptItem([2 + i, 3, 4], "") for i in range(4)]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _KernelLaunched(RuntimeError):
    pass


@pytest.mark.gpu
def test_reference_backend_launches_no_custom_kernel_in_a_jet_rl_step(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import triton.runtime.jit as triton_jit

    from jetrl.config import load_config
    from jetrl.models import DecoderConfig, build_model
    from jetrl.quant.kernels import gemm_scaled_mm
    from jetrl.rl.trainer import Trainer
    from jetrl.rollout import RolloutEngine

    launched: list[str] = []

    def refuse(self, *args, **kwargs):
        launched.append(getattr(self, "__name__", repr(self)))
        raise _KernelLaunched(f"a Triton/Gluon kernel was launched: {launched[-1]}")

    def refuse_cublas(*args, **kwargs):
        launched.append("blockwise_scaled_mm")
        raise _KernelLaunched("cuBLAS blockwise scaled_mm was called")

    monkeypatch.setattr(triton_jit.JITFunction, "run", refuse)  # Gluon's JIT functions are JITFunctions too
    monkeypatch.setattr(gemm_scaled_mm, "blockwise_scaled_mm", refuse_cublas)
    if torch.cuda.get_device_capability()[0] >= 9:  # the patch would catch the kernels: the test can fail
        with use_backend("cuda"), pytest.raises(_KernelLaunched):
            get_backend("cuda").quantize(torch.randn(128, 128, device="cuda"), ACT)
        launched.clear()
    reward = lambda texts, refs: [float(len(t) % 3) for t in texts]  # noqa: E731
    with use_backend("reference"):
        cfg = load_config(None, ["--recipe=jet", "--data.prompts_per_step=4", "--rollout.n=2",
                                 "--rollout.max_tokens=8", "--algorithm.mini_batch_size=8",
                                 "--algorithm.micro_batch_size=4", "--trainer.steps=1"])
        model = build_model(DecoderConfig(**MODEL), dtype=torch.bfloat16, device="cuda", recipe="jet", seed=0)
        engine = RolloutEngine(model, max_num_seqs=8, num_blocks=64, block_size=16, progress=False)
        trainer = Trainer(cfg, model, engine, _Prompts(), reward, lambda ids: ",".join(map(str, ids)))
        metrics = trainer.step()
    assert not launched, launched
    assert metrics["response/num_tokens"] > 0
    assert any(isinstance(m, FP8Linear) for m in model.modules()), "the jet recipe put no FP8Linear in the model"
