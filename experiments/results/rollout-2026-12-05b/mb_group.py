# bf16 decode GEMMs: q/k/v and gate/up one by one vs stacked, timed inside CUDA graphs (as the decode loop runs them)
import torch, torch.nn.functional as F, json, os, sys
torch.manual_seed(0)
dev = "cuda"
shapes = {"1.5b": (1536, 12, 2, 128, 8960, True), "0.5b": (896, 14, 2, 64, 4864, True), "8b": (4096, 32, 8, 128, 14336, False)}
def timed(fn, reps=50):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(ts)[2]
rows = []
for name, (h, nh, nkv, hd, inter, bias) in shapes.items():
    b = lambda n: torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    wq, wk, wv = (torch.randn(n, h, device=dev, dtype=torch.bfloat16) * 0.02 for n in (nh * hd, nkv * hd, nkv * hd))
    bq, bk, bv = b(nh * hd), b(nkv * hd), b(nkv * hd)
    wqkv = torch.cat([wq, wk, wv]); bqkv = torch.cat([bq, bk, bv]) if bias else None
    wg, wu = (torch.randn(inter, h, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2))
    wgu = torch.cat([wg, wu])
    for m in (16, 64, 129, 256):
        x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        sep = timed(lambda: (F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)))
        st = timed(lambda: F.linear(x, wqkv, bqkv))
        sep2 = timed(lambda: (F.linear(x, wg), F.linear(x, wu)))
        st2 = timed(lambda: F.linear(x, wgu))
        y = F.linear(x, wqkv, bqkv); ys = torch.cat([F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)], 1)
        same = bool(torch.equal(y, ys))
        rows.append(dict(shape=name, m=m, qkv_sep_us=sep, qkv_stacked_us=st, gu_sep_us=sep2, gu_stacked_us=st2, qkv_bitwise=same))
        print(f"{name:5} M={m:4} qkv {sep:7.2f} -> {st:7.2f} us   gate/up {sep2:7.2f} -> {st2:7.2f} us  qkv bitwise {same}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "mb_group.json"), "w"), indent=1)
