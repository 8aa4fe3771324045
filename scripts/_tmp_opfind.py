import sys, collections, torch
sys.path.insert(0, "bench")
from profile_step import micro_batch_inputs
from jetrl.models import build_model, logprobs_from_hidden
S = {"model_type":"qwen2","rms_norm_eps":1e-06,"rope_theta":1000000.0,"rope_scaling":None,"vocab_size":151936,"hidden_size":1536,"intermediate_size":8960,"num_hidden_layers":4,"num_attention_heads":12,"num_key_value_heads":2,"tie_word_embeddings":True,"max_position_embeddings":32768}
dev = torch.device("cuda")
for recipe in sys.argv[1].split(","):
    model = build_model(S, device=dev, recipe=recipe, seed=0)
    model.set_activation_checkpointing(True)
    ids, pos, cu, max_len, targets, rows = micro_batch_inputs(S["vocab_size"], 32, 130, 290, dev)
    def step():
        h = model.forward_packed(ids, pos, cu, max_len)
        logprobs_from_hidden(model, h[rows], targets[rows], temperature=1.0)[0].sum().backward()
    step(); step(); torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        step(); torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU or not evt.kernels:
            continue
        for k in evt.kernels:
            name = k.name
            if any(s in name for s in ("nocast", "index_elementwise", "direct_copy", "CUDAFunctor_add", "transpose", "copy_kernel", "fill", "reduce_kernel")):
                stack = " < ".join(f for f in (evt.stack or []) if "jetrl" in f)[:300]
                key = (name[:70], evt.name, str(evt.input_shapes)[:90], stack)
                agg[key][0] += k.duration
                agg[key][1] += 1
    print(f"== {recipe}")
    for key, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:22]:
        print(f"{us:9.1f} us {n:4d}x {key[0]} | {key[1]} {key[2]}\n      {key[3]}")
    del model; torch.cuda.empty_cache()
