"""The Triton paged decode kernel against ``paged_attention_reference``, on CPU under TRITON_INTERPRET=1.

The interpreter is switched on in a subprocess (this file run as a script), so other tests keep the
normal Triton mode. Shapes are small: the interpreter executes every program in Python.
"""

import importlib.util
import os
import subprocess
import sys

import pytest


def _check(seed: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, page: int,
           contexts: list[int], splits: int, dtype) -> float:
    import torch

    from jetrl.models.attention import PagedAttentionMetadata, paged_attention_reference
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // page) for c in contexts) + 3
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    width = max(-(-c // page) for c in contexts) + 1  # one spare -1 column
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-monotonic blocks
    tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    for s, c in enumerate(contexts):
        n = -(-c // page)
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    meta = PagedAttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long), max_query_len=1, max_context_len=max(contexts))
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    out = paged_decode(q, k_cache, v_cache, meta, scale, num_splits=splits, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    assert not torch.isnan(out).any()
    return float((out.float() - ref).norm() / ref.norm())


CASES = [
    # seed, S, Hq, Hkv, D, page, contexts, splits, dtype, tolerance
    (0, 3, 4, 2, 32, 4, [1, 9, 16], 1, "float32", 1e-5),  # ctx 1, partial and exact pages
    (1, 2, 8, 2, 64, 8, [37, 5], 3, "float32", 1e-5),  # context split + merge; a split with no tokens
    (2, 2, 4, 4, 48, 4, [23, 40], 2, "float32", 1e-5),  # MHA (group 1), head_dim not a power of two
    (3, 2, 8, 1, 32, 16, [50, 17], 4, "float32", 1e-5),  # MQA (group 8)
    # half precision: P is rounded to the cache dtype for P @ V (fp16: ~3e-4 relative). BF16 is covered by
    # the GPU test (tests/rollout/test_rollout_gpu.py): Triton 3.6's interpreter computes tl.dot on bf16 wrongly.
    (4, 2, 4, 2, 32, 4, [21, 6], 2, "float16", 2e-3),
]


def _run_all() -> None:
    import torch

    for seed, s, hq, hkv, d, page, ctx, splits, dtype, tol in CASES:
        err = _check(seed, s, hq, hkv, d, page, ctx, splits, getattr(torch, dtype))
        print(f"case seed={seed}: relative error {err:.2e} (tolerance {tol:.0e})")
        assert err < tol, (seed, err)
    print("ALL OK")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_paged_decode_matches_reference_under_interpreter():
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # a broken install: say so rather than fail the suite
        pytest.skip(f"triton does not import: {exc}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))  # installed or not
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    print(proc.stdout)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr


if __name__ == "__main__":
    _run_all()
