"""A forward stopped by the offload pool's limit on a GPU: what stays alive after the caller drops the model.

Found by verify_gpu.py (issue 45): after the offload row's float64 re-run failed on the pinned limit, ~17 GiB stayed
allocated for the rest of the process. Scenarios: a failing forward (twice), remat.verify(model, batch, "offload");
each prints the memory still allocated after gc and the referrers of the largest CUDA tensor left.
On the CPU (inline engine) nothing leaks (tests/test_offload.py); on CUDA it does: open.

    PYTHONPATH=src python3 benchmarks/offload_failure_gpu.py
"""
from remat.cli.verify import set_dropout

def big_cuda_tensors(exclude):
    out = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().nbytes() > 32 << 20 and id(o) not in exclude:
                out.append(o)
        except Exception:
            pass
    return out

def chain(obj, depth=0, seen=None, maxdepth=3):
    seen = seen if seen is not None else set()
    if depth > maxdepth: return
    for r in gc.get_referrers(obj):
        if id(r) in seen or isinstance(r, types.FrameType) or r is seen: continue
        if isinstance(r, list) and len(r) > 10000: continue   # gc.get_objects lists
        seen.add(id(r))
        desc = type(r).__name__
        if isinstance(r, dict):
            desc += " keys=" + ",".join(map(str, list(r.keys())[:6]))
        print("  " * depth + "<-", desc, str(r)[:100].replace("\n", " ") if not isinstance(r, dict) else "")
        if depth < maxdepth and not isinstance(r, types.ModuleType):
            chain(r, depth + 1, seen, maxdepth)
        if len(seen) > 60: return

def scenario(name, fn):
    config = load_config("llama-1b"); set_dropout(config, 0.1)
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 2048), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    fn(model, batch)
    exclude = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    del model, batch
    gc.collect(); torch.cuda.synchronize()
    print(f"== {name}: allocated after gc {torch.cuda.memory_allocated()/2**30:.2f} GiB", flush=True)
    leaked = big_cuda_tensors(exclude)
    print(f"   big CUDA tensors alive: {len(leaked)}", flush=True)
    if leaked:
        t = max(leaked, key=lambda t: t.untyped_storage().nbytes())
        print("   biggest", tuple(t.shape), t.dtype, flush=True)
        chain(t)
    del leaked
    gc.collect(); torch.cuda.empty_cache()

def verify_offload(model, batch):
    r = remat.verify(model, batch, "offload")
    print(r.verdict, r.float64[:120])

def failing_forward(model, batch):
    remat.apply(model, "offload", offload_options=dict(host_memory_limit=2 << 30))
    try:
        model(**batch).loss.backward()
    except ValueError as e:
        print("raised:", str(e)[:80])

scenario("failing forward under offload", failing_forward)
scenario("failing forward under offload, again", failing_forward)
scenario("verify offload", verify_offload)
