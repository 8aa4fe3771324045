"""The CUDA-graph toolkit the decode steps and the update share: the storage key (CPU), the capture and its
failure (GPU)."""

import warnings

import pytest
import torch

from jetrl.models import DecoderConfig, build_model
from jetrl.models.cuda_graphs import CaptureFailed, capture, storage_key, warn_eager
from jetrl.quant import fp8_linears, precision_side
from jetrl.quant.kernels import tuning

CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1)


def _jet_model(dtype=torch.float32, device="cpu"):
    model = build_model(DecoderConfig(**CONFIG), dtype=dtype, device=device, recipe="jet", seed=0)
    ids = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(0)).to(device)
    model(ids).float().sum().backward()  # the training side quantizes W and W^T: FP8 caches exist
    return model


def test_storage_key_follows_parameters_gradients_fp8_caches_and_tuning():
    model = _jet_model()
    key = storage_key(model, grads=True, transposes=True)
    assert storage_key(model, grads=True, transposes=True) == key  # nothing moved
    assert any(layer.uses_fp8() and layer.cached_fp8_tensors() for layer in fp8_linears(model))

    # a new weight version is re-quantized in place: the FP8 buffers stay, so the key does too
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    assert storage_key(model, grads=True, transposes=True) == key

    # a gradient buffer replaced (not zeroed in place) moves what an update graph accumulates into
    param = next(p for p in model.parameters() if p.grad is not None)
    param.grad = param.grad.clone()
    moved = storage_key(model, grads=True, transposes=True)
    assert moved != key
    assert storage_key(model, grads=False, transposes=True) == storage_key(model, grads=False, transposes=True)

    # a parameter moved to new storage
    before = storage_key(model, grads=False, transposes=False)
    param.data = param.data.clone()
    assert storage_key(model, grads=False, transposes=False) != before

    # the kernel tuning in force: a different one is another key, an equal one the same
    base = storage_key(model, grads=False, transposes=False)
    with tuning.override(kv_decode_factored=not tuning.current().kv_decode_factored):
        assert storage_key(model, grads=False, transposes=False) != base
    with tuning.override(exact_split_k=tuning.current().exact_split_k):
        assert storage_key(model, grads=False, transposes=False) == base


@pytest.mark.gpu
def test_storage_key_reads_the_transposes_only_when_asked():
    """A forward-only graph (the decode step) reads W alone: its key leaves the W^T copies out, so dropping them
    does not recapture the decode graphs; the update's key includes them (on the GPU the training side keeps
    W^T in FP8 for DGrad)."""
    model = _jet_model(dtype=torch.bfloat16, device="cuda")
    with tuning.override(cache_weight_t=True), precision_side("train"):  # W^T kept beside W for its version
        for layer in fp8_linears(model):
            layer._cached_weights(with_transpose=True)
        with_t = storage_key(model, grads=False, transposes=True)
        without = storage_key(model, grads=False, transposes=False)
    assert len(with_t) > len(without)


def test_a_failed_capture_warns_once_with_its_reason():
    with pytest.warns(RuntimeWarning, match=r"CUDA graph capture of the decode step failed \(RuntimeError: boom\); "
                                            r"decoding eagerly"):
        warn_eager("the decode step", CaptureFailed("RuntimeError: boom"), "decoding eagerly")
    with pytest.warns(RuntimeWarning, match=r"failed \(ValueError: bad\)"):
        warn_eager("the update's micro-batch", ValueError("bad"), "eagerly")


@pytest.mark.gpu
def test_capture_replays_fresh_inputs_and_reports_a_failed_capture():
    x = torch.randn(1000, device="cuda")
    w = torch.randn(1000, device="cuda")
    calls = []

    def run():
        calls.append(1)
        return torch.tanh(x * w).cumsum(0)

    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    graph, out = capture(run, stream=stream, pool=pool, warmup=True)
    assert len(calls) == 2  # the warm-up and the capture
    for _ in range(3):
        x.copy_(torch.randn(1000, device="cuda"))
        graph.replay()
        assert torch.equal(out, torch.tanh(x * w).cumsum(0))

    def forbidden():  # a host synchronization inside a capture invalidates it
        y = x * 2
        torch.cuda.synchronize()
        return y

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning about resetting the failed graph
        with pytest.raises(CaptureFailed):
            capture(forbidden, stream=stream, pool=pool)
    # the device can still capture after a failed capture, on the same stream, into a fresh pool; the graph
    # captured before it still replays
    graph2, out2 = capture(run, stream=stream, pool=torch.cuda.graph_pool_handle())
    x.copy_(torch.randn(1000, device="cuda"))
    graph2.replay()
    graph.replay()
    assert torch.equal(out2, torch.tanh(x * w).cumsum(0)) and torch.equal(out, out2)


@pytest.mark.gpu
def test_capture_survives_an_earlier_graph_left_to_the_cyclic_collector():
    """An unreachable graph in a reference cycle (an engine and its runner, say) is freed by the cyclic collector,
    whenever a collection runs; destroying a graph inside another's capture invalidates it (pytorch/pytorch#161037).
    The capture keeps the collector off: with a threshold that collects at every allocation, it still captures,
    and the old graph goes at the next collection after it."""
    import gc
    import weakref

    class Holder:  # a graph in a cycle: only the cyclic collector frees it
        def __init__(self, graph):
            self.graph, self.me = graph, self

    x = torch.randn(1000, device="cuda")
    stream = torch.cuda.Stream()
    old, _ = capture(lambda: x * 2, stream=stream, pool=torch.cuda.graph_pool_handle())
    holder = weakref.ref(Holder(old))
    del old
    assert holder() is not None

    def run():  # allocates Python containers, as a model's forward does: a collection would run here
        junk = [[i] for i in range(1000)]
        return x * len(junk)

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph, out = capture(run, stream=stream, pool=torch.cuda.graph_pool_handle())
        assert gc.isenabled()
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert holder() is None
    graph.replay()
    assert torch.equal(out, x * 1000)
