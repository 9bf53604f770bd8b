"""The offload engine against an untouched copy of the same model: loss and every gradient equal
(``torch.equal``: offload moves bytes, it never changes the math).

On CPU the engine is a no-op; its bookkeeping (records, slots, dedup of views, prefetch order,
tensors that are never moved, retain_graph, pool reuse, garbage collection of forwards without
backward) runs for real in the private ``_inline`` mode, where copies are synchronous CPU copies,
and under ``Deferred``, a CPU model of streams where a side-stream copy runs only when something
waits on it (or at random): a missing wait reads 0xFF garbage (NaN), a buffer given up while a copy
into or out of it is still queued is logged as a hazard. GPU tests (marked) run the streams, with
copies slowed down on purpose so that a missing wait or an early free shows up as a wrong number.
"""
import contextlib
import copy
import gc
import random
import warnings
import weakref

import pytest
import torch

import remat
from remat.treat.discovery import discover
# private (_Inline, engine._pack, _devs ...): the engine's CPU device and bookkeeping, which the test doubles
# below replace; on the CPU the public path moves nothing
from remat.offload.engine import MiB, OffloadEngine, PinnedPool, _Inline
from remat.treat.treatments import engine_of
from remat.planning.offload_model import gpu_overhead_bytes
from remat.presets import build_model, load_config
from remat.planning.records import block_record
from remat.treat.treatments import apply_treatment

import oracle

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tiny(device="cpu", dropout=0.1, attn="eager"):
    config = load_config("llama-tiny")
    config.attention_dropout = dropout
    return build_model(config, device=device, dtype=torch.float32, attn_implementation=attn)


def _treat(model, spec, **engine_kwargs):
    engine = OffloadEngine(model, **engine_kwargs)
    for index, (_, block) in enumerate(discover(model).blocks(model)):
        apply_treatment(block, block_record(spec, index=index), engine=engine)
    return engine


def _use(engine, dev):
    """Put a test double in place of the engine's CPU device object; returns it."""
    engine._devs = {dev.device: dev}
    return dev


def _ids(device="cpu", batch=2, seq=37):
    torch.manual_seed(11)
    return torch.randint(0, 512, (batch, seq), device=device)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    oracle.model_loss(model, ids).backward()


def _micro_batches(model, batches):
    """Gradient accumulation: two forwards, then one backward over both."""
    return sum(oracle.model_loss(model, ids) for ids in batches)


# -- CPU: the public path is a no-op with one warning ------------------------------------------------

@pytest.mark.parametrize("spec", ["offload", "full+offload"])
def test_apply_on_cpu_is_a_noop_with_one_warning_and_equal_gradients(spec):
    model = _tiny()
    reference = copy.deepcopy(model)
    remat.apply(model, spec)
    ids = _ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        oracle.compare(model, reference, ids, steps=2).assert_equal()
    ours = [w for w in caught if "remat offload" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "CUDA is not available" in str(ours[0].message) or "not on a CUDA device" in str(ours[0].message)
    engine = engine_of(model)
    assert engine is not None and engine.stats()["tensors_seen"] == 0


def test_full_offload_hooks_see_only_the_checkpoint_inputs():
    """Non-reentrant checkpoint saves its inputs (positional, and tensor keywords, which remat
    passes positionally) under the caller's hooks, and nothing else."""

    class Counting:
        def __init__(self):
            self.seen = []

        def saved_tensors(self, key):
            return torch.autograd.graph.saved_tensors_hooks(lambda t: self.seen.append((key, t)) or t,
                                                            lambda t: t)

    model = _tiny()
    blocks = discover(model).blocks(model)
    inputs = []
    for _, block in blocks:
        block.register_forward_pre_hook(
            lambda m, args, kwargs: inputs.append(list(args) + [v for v in kwargs.values()
                                                                if isinstance(v, torch.Tensor)]),
            with_kwargs=True)
    counting = Counting()
    for index, (_, block) in enumerate(blocks):
        apply_treatment(block, block_record("full+offload", index=index), engine=counting)
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    positional = [[a for a in args if isinstance(a, torch.Tensor)] for args in inputs]
    # some torch versions (2.11) also pass checkpoint's 0-element placeholder through the hooks
    data = [(key, t) for key, t in counting.seen if t.numel()]
    expected = [t for tensors in positional for t in tensors]
    assert len(data) == len(expected) >= len(blocks)
    assert len(counting.seen) - len(data) in (0, len(blocks))
    for (key, seen), tensor in zip(data, expected):
        assert seen.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    # offload without checkpoint: the same hooks see every activation the block saves
    plain = _tiny()
    counting = Counting()
    for index, (_, block) in enumerate(discover(plain).blocks(plain)):
        apply_treatment(block, block_record("offload", index=index), engine=counting)
    plain(input_ids=_ids(), labels=_ids()).loss.backward()
    assert len(counting.seen) > 10 * len(blocks)


# -- CPU: the engine's bookkeeping, copies made synchronous -------------------------------------------

@pytest.mark.parametrize("spec", ["offload", "full+offload"])
def test_inline_engine_gradients_equal_and_pool_reused(spec):
    model = _tiny()
    reference = copy.deepcopy(model)
    engine = _treat(model, spec, min_bytes=0, _inline=True)
    ids = _ids()
    oracle.check_mechanism(model, oracle.compare(model, reference, ids).assert_equal())
    first = engine.stats()
    assert first["bytes_d2h"] == first["bytes_h2d"] == first["bytes_packed"] > 0
    assert first["pinned_in_use_bytes"] == 0 and first["live_records"] == 0
    oracle.compare(model, reference, ids).assert_equal()
    assert engine.stats()["pinned_allocations"] == first["pinned_allocations"]  # step 2 allocates nothing
    if spec == "full+offload":  # the block inputs (and tensor keywords), plus checkpoint's placeholder on some versions
        blocks = len(discover(model).block_names)
        moved = first["tensors_seen"] - first["tensors_kept_other"] - first["tensors_kept_small"]
        # torch 2.6 also passes checkpoint's empty placeholder (one a block), which moves nothing
        assert first["slots"] in (moved, moved - blocks) and first["slots"] >= blocks


def test_inline_engine_input_gradients_with_embeds_requiring_grad():
    from families import FAMILIES
    model, make_inputs = FAMILIES["llama"]()
    reference = copy.deepcopy(model)
    _treat(model, "offload", min_bytes=0, _inline=True)
    torch.manual_seed(1)
    inputs = make_inputs()
    assert inputs["inputs_embeds"].requires_grad  # its gradient is compared
    oracle.check(model, reference, inputs)


def test_parameters_and_small_tensors_stay():
    model = _tiny()
    engine = _treat(model, "offload", min_bytes=4096, _inline=True)
    _step(model, _ids())
    s = engine.stats()
    assert s["tensors_kept_param"] > 0 and s["tensors_kept_small"] > 0 and s["slots"] > 0
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, kept_with_graph = [], []
    engine._pack_orig = engine._pack

    def spy(record, t):
        out = engine._pack_orig(record, t)
        if isinstance(out, torch.Tensor):  # kept in place: handed back detached, never with its grad_fn
            if out is t or out.grad_fn is not None:
                kept_with_graph.append(tuple(t.shape))
        else:
            seen.append(t.untyped_storage().data_ptr())
        return out
    engine._pack = spy
    _step(model, _ids())
    assert seen and not params.intersection(seen)
    assert not kept_with_graph


def test_views_of_one_storage_move_once_and_come_back_as_views():
    model = torch.nn.Linear(8, 8)  # the engine only needs the model for its parameters
    engine = OffloadEngine(model, min_bytes=0, _inline=True)

    def run(x, small):
        base = x * 2
        y = (base.t() * base[:, :8].t()).sum() + (base[1:] ** 2).sum()  # three views of one storage
        return y + (small[:10] * x[0, :1]).sum()  # views covering 1% and 2% of their storages

    x, small = torch.randn(6, 8, requires_grad=True), torch.randn(1000, requires_grad=True)
    ref_x, ref_small = x.detach().clone().requires_grad_(), small.detach().clone().requires_grad_()
    with engine.saved_tensors(0):
        out = run(x, small)
    out.backward()
    run(ref_x, ref_small).backward()
    assert torch.equal(x.grad, ref_x.grad) and torch.equal(small.grad, ref_small.grad)
    s = engine.stats()
    assert s["tensors_seen"] == 5
    assert s["slots"] == 3 and s["bytes_packed"] == 6 * 8 * 4 + 10 * 4 + 1 * 4  # base once, two spans


def test_tail_never_moved_when_backward_comes_first():
    """Copies not issued by the time backward needs them stay on the GPU: no bytes either way."""
    model = _tiny()
    reference = copy.deepcopy(model)
    engine = _treat(model, "offload", min_bytes=0, _inline=True)
    engine._issue_window = 0
    engine.max_pending_bytes = 1 << 40
    oracle.compare(model, reference, _ids()).assert_equal()
    s = engine.stats()
    assert s["bytes_d2h"] == s["bytes_h2d"] == 0 and s["bytes_never_moved"] == s["bytes_packed"] > 0


def test_pending_limit_forces_copies_out():
    model = _tiny()
    reference = copy.deepcopy(model)
    engine = _treat(model, "offload", min_bytes=0, _inline=True)
    engine._issue_window = 0
    engine.max_pending_bytes = 0
    oracle.compare(model, reference, _ids()).assert_equal()
    s = engine.stats()
    assert s["bytes_never_moved"] == 0 and s["bytes_d2h"] == s["bytes_packed"] > 0


class _LaggingEvent:
    """Completes on the third query (or when waited for): copies still in flight when backward comes."""

    def __init__(self):
        self.queries = 0

    def record(self, stream=None):
        pass

    def query(self):
        self.queries += 1
        return self.queries >= 3

    def synchronize(self):
        self.queries = 3

    def elapsed_time(self, other):
        return 0.0


def test_copies_in_flight_at_backward_are_used_from_the_gpu():
    class Lagging(_Inline):
        @staticmethod
        def event(timing=False):
            return _LaggingEvent()

    model = _tiny()
    reference = copy.deepcopy(model)
    engine = _treat(model, "offload", min_bytes=0, _inline=True)
    _use(engine, Lagging())
    engine.max_pending_bytes = 1 << 40
    for _ in range(2):
        oracle.compare(model, reference, _ids()).assert_equal()
    s = engine.stats()
    assert 0 < s["bytes_h2d"] < s["bytes_d2h"] == s["bytes_packed"]  # some came back without a copy
    assert s["pinned_in_use_bytes"] == 0 and s["live_records"] == 0


def test_retain_graph_and_gradient_accumulation():
    model = _tiny()
    reference = copy.deepcopy(model)
    engine = _treat(model, "offload", min_bytes=0, _inline=True)
    oracle.check(model, reference, _ids(), retain=True)  # every saved tensor unpacked twice
    oracle.check(model, reference, (_ids(seq=19), _ids(seq=23)), loss=_micro_batches)
    assert engine.stats()["pinned_in_use_bytes"] == 0


def test_forward_without_backward_returns_buffers_on_collection():
    model = _tiny()
    engine = _treat(model, "offload", min_bytes=0, _inline=True)
    loss = model(input_ids=_ids(), labels=_ids()).loss
    assert engine.stats()["pinned_in_use_bytes"] > 0
    del loss
    gc.collect()
    s = engine.stats()
    assert s["pinned_in_use_bytes"] == 0 and s["live_records"] == 0
    with torch.no_grad():
        model(input_ids=_ids(), labels=_ids())
    assert engine.stats()["tensors_seen"] == s["tensors_seen"]  # no_grad: the hooks never run


# -- CPU: streams modelled, copies run late ------------------------------------------------------

class _Queue:
    """A side stream: its operations run in order, only when something waits for them.

    Compares like ``torch.Stream`` (unequal to None is False), so code that compares streams with
    ``!=`` breaks here as it did on the GPU.
    """

    def __init__(self):
        self.ops, self.done = [], 0

    def __eq__(self, other):
        return other is not None and self is other

    def __ne__(self, other):
        return other is not None and self is not other

    __hash__ = object.__hash__

    def wait_event(self, event):
        if event.stream is not None and event.stream is not self:
            self.ops.append(lambda: event.stream.run(event.pos))

    def run(self, upto):
        while self.done < upto:
            self.done += 1
            self.ops[self.done - 1]()


class _Compute(_Queue):
    """The compute stream runs at once: waiting on an event runs that event's stream up to it."""

    def wait_event(self, event):
        event.synchronize()


class _DeferredEvent:
    def __init__(self, dev):
        self.dev, self.stream, self.pos = dev, None, 0

    def record(self, stream=None):
        stream = self.dev.current() if stream is None else stream
        self.stream, self.pos = (None, 0) if stream is self.dev.compute else (stream, len(stream.ops))

    def query(self):
        self.dev.progress()
        return self.stream is None or self.stream.done >= self.pos

    def synchronize(self):
        if self.stream is not None:
            self.stream.run(self.pos)

    def elapsed_time(self, other):
        return 0.0


class Deferred(_Inline):
    def __init__(self, seed=0, progress=0.0):
        self.compute, self.d2h, self.h2d = _Compute(), _Queue(), _Queue()
        self._now = self.compute
        self.rng, self.p = random.Random(seed), progress
        self.hazards, self.held = [], []

    def current(self):
        return self._now

    @contextlib.contextmanager
    def on(self, stream):
        before, self._now = self._now, stream
        try:
            yield
        finally:
            self._now = before

    def event(self, timing=False):
        return _DeferredEvent(self)

    def empty(self, nbytes):
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8)  # what a read before the copy sees

    def copy(self, dst, src):
        stream = self._now
        assert stream in (self.d2h, self.h2d), "copies run on the copy streams"
        gpu = weakref.ref(dst if stream is self.h2d else src)  # the engine must hold it until done
        what = "host-to-device destination" if stream is self.h2d else "device-to-host source"

        def op():
            tensor = gpu()
            if tensor is None:
                self.hazards.append(f"{what} given up while its copy was queued")
            elif stream is self.h2d:
                tensor.copy_(src)
            else:
                dst.copy_(tensor)
        stream.ops.append(op)

    def free_after(self, tensor, stream):
        self.held.append(tensor)  # the allocator's record_stream: the block outlives the queued copy

    def progress(self):
        for queue in (self.d2h, self.h2d):
            if queue.done < len(queue.ops) and self.rng.random() < self.p:
                queue.run(queue.done + 1)


@pytest.mark.parametrize("spec", ["offload", "full+offload"])
@pytest.mark.parametrize("window, progress", [(None, 0.0), (0, 0.0), (1 << 40, 0.3), (None, 0.7)])
def test_deferred_copies_gradients_equal_and_no_hazards(spec, window, progress):
    model = _tiny()
    reference = copy.deepcopy(model)
    engine = _treat(model, spec, min_bytes=0, _inline=True, max_pending_bytes=window)
    dev = _use(engine, Deferred(seed=len(spec) + progress, progress=progress))
    ids = _ids()
    oracle.compare(model, reference, ids).assert_equal()
    first = engine.stats()
    if window == 0:  # everything went through the host: each slot's fetch was waited for
        assert first["bytes_d2h"] == first["bytes_h2d"] == first["bytes_packed"]
        assert first["compute_waits"] >= first["slots"]
    oracle.compare(model, reference, ids, retain=True).assert_equal()
    oracle.compare(model, reference, (_ids(seq=19), ids), loss=_micro_batches).assert_equal()
    s = engine.stats()
    assert not dev.hazards, dev.hazards[:3]
    assert s["bytes_h2d"] > 0 and s["pinned_in_use_bytes"] == 0 and s["live_records"] == 0


def test_deferred_partial_views_read_from_the_original_storage():
    """A span that starts inside its storage, used from the GPU tensor while its copy is queued."""
    model = torch.nn.Linear(8, 8)
    engine = OffloadEngine(model, min_bytes=0, _inline=True, max_pending_bytes=1 << 40)
    dev = _use(engine, Deferred())

    def run(big):
        return (big[700:710] * big[700:710].exp()).sum()  # saves a 10-element view 700 elements in

    big, ref = torch.randn(1000, requires_grad=True), None
    ref = big.detach().clone().requires_grad_()
    with engine.saved_tensors(0):
        out = run(big * 1)
    assert engine._inflight and not dev.d2h.done  # nothing has landed: backward reads the original
    out.backward()
    run(ref * 1).backward()
    assert torch.equal(big.grad, ref.grad) and not dev.hazards


# -- the memory the engine adds ---------------------------------------------------------------------

def test_the_planner_models_the_engine_defaults():
    from remat.offload import DEFAULT_WINDOW_RECORDS
    from remat.planning import offload_model
    assert DEFAULT_WINDOW_RECORDS == offload_model.DEFAULT_WINDOW_RECORDS


def test_gpu_overhead_bytes_rule():
    o = gpu_overhead_bytes([4, 4, 4, 4], None, 1)
    assert o["window"] == 4 and o["head"] == 4
    assert o["forward"] == [0, 4, 4, 4]
    assert o["backward"] == [0, 4, 4, 4]  # block 0: nothing before; the tail belongs to block 3
    o = gpu_overhead_bytes([4, 0, 4, 0, 4], 6, 1)  # every other block; window 6
    assert o["forward"] == [0, 4, 4, 6, 6] and o["head"] == 6
    # the forward's tail (6 newest bytes) is block 4 and half of block 2: nothing older than the
    # prefetched block remains, so each backward holds just the one block prefetched
    assert o["backward"] == [0, 4, 4, 4, 4]
    assert gpu_overhead_bytes([4, 4, 4], 0, 2)["backward"] == [0, 4, 8]
    assert gpu_overhead_bytes([4, 4, 4], 12, 0)["backward"] == [0, 4, 8]  # the forward's tail, unprefetched
    assert gpu_overhead_bytes([0, 3, 0], None, 1)["backward"] == [0, 0, 3]  # block 2 runs before any fetch
    with pytest.raises(ValueError, match="block_bytes"):
        gpu_overhead_bytes([1, -1])
    with pytest.raises(ValueError, match="max_pending_bytes"):
        gpu_overhead_bytes([1], -1)


def test_engine_holds_no_more_than_the_rule_says():
    """Under maximal lag, what the engine holds for earlier records at each pack and at the head."""
    model = _tiny()
    engine = _treat(model, "offload", min_bytes=0, _inline=True)
    _use(engine, Deferred())
    held = []
    pack = engine._pack

    def spy(record, t):
        out = pack(record, t)
        mine = sum(s.nbytes for s in record.slots if s.state in ("pending", "in flight"))
        held.append((record.key, engine._pending_bytes + engine._inflight_bytes - mine))
        return out
    engine._pack = spy
    for _ in range(2):  # the second step runs with the default window known from the first
        held.clear()
        loss = model(input_ids=_ids(), labels=_ids()).loss
        head = engine._pending_bytes + engine._inflight_bytes
        loss.backward()
    by_block = engine.stats()["bytes_packed_by_block"]
    rule = gpu_overhead_bytes([by_block[k] // 2 for k in sorted(by_block)])
    assert rule["window"] == engine.window_bytes() > 0
    assert all(h <= rule["forward"][k] for k, h in held) and head <= rule["head"]
    assert max(h for _, h in held) > 0 and head > 0  # the bound is reached, not vacuous


# -- the pinned pool -----------------------------------------------------------------------------

def test_pool_reuses_buffers_by_size_class():
    pool = PinnedPool(limit=64 * MiB, pin=False)
    a, fence = pool.take(3 * MiB)
    assert a.numel() == 4 * MiB and fence is None and pool.allocations == 1
    pool.give(a, "event")
    b, fence = pool.take(4 * MiB - 1)
    assert b.data_ptr() == a.data_ptr() and fence == "event" and pool.allocations == 1
    assert pool.in_use_bytes == pool.held_bytes == 4 * MiB


def test_pool_error_names_need_and_limit():
    pool = PinnedPool(limit=10 * MiB, pin=False)
    pool.take(4 * MiB)
    free, _ = pool.take(2 * MiB)
    pool.give(free)
    with pytest.raises(ValueError) as error:
        pool.take(5 * MiB)  # 8 MiB class; the free 2 MiB buffer is dropped first, still too much
    message = str(error.value)
    assert "12.00 MiB" in message and "10.00 MiB" in message and "needs at least" in message and "Offload fewer blocks" in message
    assert "host_memory_limit" in message and pool.held_bytes == 4 * MiB


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        OffloadEngine("model")
    with pytest.raises(ValueError, match="min_bytes"):
        OffloadEngine(torch.nn.Linear(2, 2), min_bytes=-1)
    with pytest.raises(ValueError, match="host memory limit"):
        PinnedPool(limit=0)


# -- GPU: real streams, copies slowed down -------------------------------------------------------

def _gpu_pair(spec, **engine_kwargs):
    model = _tiny(device="cuda")
    reference = copy.deepcopy(model)
    remat.apply(model, spec)
    engine = engine_of(model)
    engine.min_bytes = 0  # llama-tiny's activations are all small: move every one
    for key, value in engine_kwargs.items():
        setattr(engine, key, value)
    return model, reference, engine


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spec", ["offload", "full+offload"])
@pytest.mark.parametrize("mode", ["plain", "slow_copies_lagging", "slow_copies_waited"])
def test_gpu_gradients_equal_no_offload(spec, mode):
    settings = {"plain": {}, "slow_copies_lagging": {"_delay": 2_000_000, "max_pending_bytes": 1 << 40},
                "slow_copies_waited": {"_delay": 2_000_000, "max_pending_bytes": 0}}[mode]
    model, reference, engine = _gpu_pair(spec, **settings)
    ids = _ids("cuda", batch=4, seq=128)
    oracle.compare(model, reference, ids).assert_equal()
    first = engine.stats()
    assert first["bytes_packed"] > 0 and first["pinned_in_use_bytes"] == 0
    if mode == "slow_copies_waited":  # every slot went through the host and was waited for
        assert first["bytes_d2h"] == first["bytes_h2d"] == first["bytes_packed"]
        assert first["compute_waits"] >= first["slots"]
    oracle.compare(model, reference, ids).assert_equal()
    assert engine.stats()["pinned_allocations"] == first["pinned_allocations"]  # pool reused in step 2
    oracle.compare(model, reference, ids, retain=True).assert_equal()


@pytest.mark.gpu
@cuda
def test_gpu_bf16_sdpa_bench_shapes_small():
    """The bench path in miniature: bf16, SDPA, default min_bytes, tensors large enough to move."""
    config = load_config("llama-tiny")
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 512, 2048, 8
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    remat.apply(model, "offload")
    engine = engine_of(model)
    ids = _ids("cuda", batch=4, seq=512)
    oracle.check(model, reference, ids, steps=2)
    s = engine.stats()
    assert s["bytes_d2h"] > 0 and s["tensors_kept_param"] > 0 and s["pinned_in_use_bytes"] == 0


@pytest.mark.parametrize("min_bytes", [0, 8192])   # every tensor moved; small ones kept on the device
@pytest.mark.parametrize("limit", [200_000, 8_000_000])   # the first block's pack, a later block's
def test_a_step_stopped_by_the_pool_limit_leaves_nothing_alive(limit, min_bytes):
    """A forward stopped by the pinned pool's limit raises, and once the caller drops the model its
    memory can go: the half-built graph, never differentiated, holds no cycle through autograd's
    saved-tensor hooks (a pack hook that hands back a kept tensor itself, grad_fn included, makes
    one: output -> grad_fn -> saved variable -> output, which gc cannot see; it kept the model and
    ~3 GiB per failed step alive on an H200)."""
    model = _tiny()
    remat.apply(model, "offload", offload_options=dict(min_bytes=min_bytes, _inline=True,
                                                       host_memory_limit=limit))
    ids = _ids(seq=256)
    alive = weakref.ref(model)
    with pytest.raises(ValueError, match="pinned host memory would exceed its limit"):
        model(input_ids=ids, labels=ids)
    del model
    gc.collect()
    assert alive() is None
