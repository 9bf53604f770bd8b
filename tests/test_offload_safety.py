"""The offload engine where it used to be unsafe: in-place writes to saved tensors, handles dropped
from other threads or garbage collection, a slot read on a second stream, blocks on several
devices, parameters and FSDP2 storages, and copies of an offloaded model (issue 14).

On CPU the engine runs in its private ``_inline`` mode, under test doubles of its device objects
(``Deferred`` from test_offload: side-stream copies run only when something waits on them, or at
random). GPU tests carry the ``gpu`` marker. The FSDP2 test runs this file as a worker process
(gloo, world size 1, CPU), as tests/test_fsdp.py does for the other treatments.
"""
import contextlib
import copy
import gc
import os
import pickle
import sys
import threading
import weakref

import pytest
import torch
import torch.nn as nn

import remat
# private (_Inline, _Packed): the engine's CPU device and its packed handle, doubled and inspected below
from remat.offload.engine import OffloadEngine, _Inline, _Packed, keep_reason, parameter_storages
from remat.treat.treatments import engine_of
import oracle
from launches import launch
from test_offload import Deferred, _Compute, _ids, _tiny, _use

INPLACE = "one of the variables needed for gradient computation has been modified by an inplace operation"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(nn.Module):
    """Saves ``h`` twice (sigmoid's result, ``b``'s input); ``write`` then scales it in place."""

    def __init__(self, width, write):
        super().__init__()
        self.a, self.b, self.write = nn.Linear(width, width), nn.Linear(width, width), write

    def forward(self, x):
        h = torch.sigmoid(self.a(x))
        out = self.b(h)
        if self.write:
            h.mul_(2)
        return out


class Stack(nn.Module):
    """Four blocks, each under ``engine.saved_tensors(i)`` when an engine is set."""

    def __init__(self, width=32, write=False, blocks=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, write) for _ in range(blocks))
        self.engine = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            with self.engine.saved_tensors(i) if self.engine is not None else contextlib.nullcontext():
                x = block(x)
        return x


def _pair(write=False, device="cpu", **engine_kwargs):
    torch.manual_seed(0)
    model = Stack(write=write).to(device)
    reference = copy.deepcopy(model)
    model.engine = OffloadEngine(model, min_bytes=0, **engine_kwargs)
    return model, reference, model.engine


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


# -- 1. in-place writes to saved tensors ----------------------------------------------------------

# window None/progress 0: copies queued or in flight when the backward comes (kept on the GPU);
# window 0: every copy forced out, before the write; a huge window with random progress: a mix
WINDOWS = [(None, 0.0), (0, 0.0), (1 << 40, 0.5), (None, 1.0)]


@pytest.mark.parametrize("window, progress", WINDOWS)
def test_inplace_write_to_a_saved_tensor_raises_as_autograd_does(window, progress):
    model, reference, engine = _pair(write=True, _inline=True, max_pending_bytes=window)
    dev = _use(engine, Deferred(seed=7, progress=progress))
    x = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match=INPLACE):  # what the same model does without remat
        _grads(reference, x)
    with pytest.raises(RuntimeError, match=INPLACE) as error:
        _grads(model, x)
    assert "saved for backward in an offloaded block" in str(error.value)
    assert not dev.hazards, dev.hazards[:3]
    del error  # its traceback holds the graph
    gc.collect()
    assert engine.stats()["live_records"] == 0 and engine.pool.in_use_bytes == 0


@pytest.mark.parametrize("window, progress", WINDOWS)
def test_no_write_no_error_and_equal_gradients(window, progress):
    model, reference, engine = _pair(write=False, _inline=True, max_pending_bytes=window)
    _use(engine, Deferred(seed=7, progress=progress))
    x = torch.randn(8, 32)
    for _ in range(2):
        for ours, theirs in zip(_grads(model, x), _grads(reference, x)):
            assert torch.equal(ours, theirs)
    assert engine.stats()["slots"] > 0


def test_write_after_the_block_to_a_tensor_still_alive_raises():
    """The block's output is saved inside it (sigmoid's result); the caller writes to it later."""
    engine = OffloadEngine(nn.Linear(1, 1), min_bytes=0, _inline=True, max_pending_bytes=0)
    _use(engine, Deferred())
    x = torch.randn(64, requires_grad=True)
    with engine.saved_tensors(0):
        out = torch.sigmoid(x * 1)
    assert engine.stats()["bytes_d2h"] > 0  # its copy landed before the write
    loss = out.sum()
    out.mul_(3)
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


# -- 2. __del__ only queues; the engine drains under its lock -------------------------------------

def _watch_finalize(engine):
    calls = []
    finalize = engine._finalize

    def spy(record):
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            frames.append(frame.f_code.co_name)
            frame = frame.f_back
        calls.append((threading.current_thread(), "__del__" in frames))
        return finalize(record)
    engine._finalize = spy
    return calls


def test_handles_dropped_anywhere_are_released_by_the_engine_not_by_del():
    model, _, engine = _pair(_inline=True)
    calls = _watch_finalize(engine)
    x = torch.randn(8, 32)
    _grads(model, x)
    # the backward's end drained the queue: nothing is left waiting for the next call
    assert engine._live == {} and engine.pool.in_use_bytes == 0 and len(calls) == 4
    # a forward whose graph is dropped on another thread: the records wait in the queue
    loss = model(x).sum()
    dropper = threading.Thread(target=lambda holder: holder.clear(), args=([loss],))
    del loss
    dropper.start()
    dropper.join()
    gc.collect()
    assert len(calls) == 4 and engine._released
    assert engine.stats()["pinned_in_use_bytes"] == 0  # drained here, on this thread
    assert len(calls) == 8
    assert all(thread is threading.main_thread() and not in_del for thread, in_del in calls), calls


def test_garbage_collection_inside_a_pack_does_not_reenter_the_engine():
    model, _, engine = _pair(_inline=True)
    calls = _watch_finalize(engine)
    x = torch.randn(8, 32)
    cycle = [model(x).sum()]
    cycle.append(cycle)  # only the collector frees this forward's graph
    cycle_alive = weakref.ref(cycle[0])
    del cycle
    pack = engine._pack

    def collecting_pack(record, t):
        if cycle_alive():
            gc.collect()  # as an allocation inside a pack may: the graph's handles die mid-pack
        return pack(record, t)
    engine._pack = collecting_pack
    _grads(model, x)
    assert len(calls) == 8 and not any(in_del for _, in_del in calls), calls
    assert engine.stats()["live_records"] == 0


# -- 3. every stream that reads a slot's GPU memory is recorded -----------------------------------

class TwoStreams(Deferred):
    """Deferred with a second compute stream; remembers which stream allocated each buffer and
    which streams ``free_after`` was told about."""

    def __init__(self):
        super().__init__()
        self.other = _Compute()
        self.allocated, self.recorded = {}, set()

    def empty(self, nbytes):
        buffer = super().empty(nbytes)
        self.allocated[buffer.untyped_storage()._cdata] = self._now
        self.held.append(buffer)  # keeps storage identities unique for the test's bookkeeping
        return buffer

    def free_after(self, tensor, stream):
        super().free_after(tensor, stream)
        self.recorded.add((tensor.untyped_storage()._cdata, id(stream)))


@pytest.mark.parametrize("window", [0, 1 << 40])
def test_a_slot_read_on_another_stream_is_recorded_on_it(window):
    model, reference, engine = _pair(_inline=True, max_pending_bytes=window, prefetch_blocks=1)
    dev = _use(engine, TwoStreams())
    streams = [dev.compute, dev.other]
    unpack, uses = engine._unpack, []

    def unpack_on_block_stream(packed):
        # odd blocks' backward runs on the other stream: a prefetched slot is read by a stream
        # that did not allocate it, an original by one that did not produce it
        if not isinstance(packed, _Packed):
            return unpack(packed)
        dev._now = streams[packed.slot.record.key % 2]
        try:
            out = unpack(packed)
        finally:
            dev._now = dev.compute
        uses.append((out.untyped_storage(), streams[packed.slot.record.key % 2]))
        return out
    engine._unpack = unpack_on_block_stream
    x = torch.randn(8, 32)
    for ours, theirs in zip(_grads(model, x), _grads(reference, x)):
        assert torch.equal(ours, theirs)
    foreign = {(s._cdata, id(stream)) for s, stream in uses
               if dev.allocated.get(s._cdata, dev.compute) is not stream}
    assert foreign and foreign <= dev.recorded, foreign - dev.recorded


# -- 4. every block offloads from its own device --------------------------------------------------

class OtherDevice(_Inline):
    """A second device for the engine: meta tensors, copies that move no bytes."""

    device = torch.device("meta")

    def __init__(self):
        self.copies = 0

    def copy(self, dst, src):
        self.copies += 1


def test_blocks_on_two_devices_each_offload_from_their_own():
    torch.manual_seed(0)
    first, second = Block(32, False), Block(32, False).to("meta")
    model = nn.ModuleList([first, second])
    engine = OffloadEngine(model, min_bytes=0, _inline=True)
    other = OtherDevice()
    engine._devs[other.device] = other
    x = torch.randn(8, 32, requires_grad=True)
    with engine.saved_tensors(0):
        a = first(x).sum()
    with engine.saved_tensors(1):
        b = second(torch.randn(8, 32, device="meta", requires_grad=True)).sum()
    torch.autograd.backward([a, b])
    s = engine.stats()
    assert s["bytes_packed_by_block"][0] == s["bytes_packed_by_block"][1] > 0
    assert other.copies > 0 and s["tensors_kept_other"] == 0
    assert first.a.weight.grad is not None and second.a.weight.grad.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_blocks_on_two_gpus_both_offload():
    torch.manual_seed(0)
    model = Stack(width=256)
    reference = copy.deepcopy(model).cuda()
    for i, block in enumerate(model.blocks):
        block.to(f"cuda:{i % 2}")
    model.engine = OffloadEngine(model, min_bytes=0, max_pending_bytes=0)

    def run(m, devices):
        m.zero_grad(set_to_none=True)
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
        for i, block in enumerate(m.blocks):
            x = x.to(devices[i])
            with m.engine.saved_tensors(i) if m.engine is not None else contextlib.nullcontext():
                x = block(x)
        x.square().sum().backward()
        return [p.grad.cpu() for p in m.parameters()]
    ours = run(model, [f"cuda:{i % 2}" for i in range(4)])
    theirs = run(reference, ["cuda:0"] * 4)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    s = model.engine.stats()
    assert all(s["bytes_packed_by_block"][i] > 0 for i in range(4)) and s["bytes_d2h"] == s["bytes_packed"]
    assert set(model.engine._devs) == {torch.device("cuda", 0), torch.device("cuda", 1)}


# -- 5. parameters, FSDP storages and subclasses stay -----------------------------------------------

def test_keep_reason_by_storage_identity():
    layer = nn.Linear(4, 4)
    params = parameter_storages(layer)
    w = layer.weight
    assert keep_reason(w, params) == keep_reason(w.t(), params) == "param"
    assert keep_reason(w.detach(), params) == "param"  # same storage, neither a Parameter nor a view
    assert keep_reason(w.detach().clone(), params) is None
    assert keep_reason(torch.randn(3) * 1, params) is None

    class Sub(torch.Tensor):
        pass
    assert keep_reason(torch.randn(3).as_subclass(Sub), params) == "other"
    freed = torch.randn(8)
    freed.untyped_storage().resize_(0)  # what FSDP2 does to a resharded parameter's storage
    assert keep_reason(freed, params) == "other"
    assert keep_reason(torch.empty(0), params) == "other"


def _run_fsdp_worker(device):
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)  # cwd changes below
    [(code, out, err)] = launch(__file__, ["fsdp", device], world=1, timeout=300, cpu_only=device == "cpu",
                                cwd=os.path.dirname(__file__), env={"PYTHONPATH": path})
    assert code == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "OK", out


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7),
                    reason="FSDP2 on the CPU needs torch >= 2.7")
def test_offload_then_fully_shard_keeps_fsdp_storages_and_gives_same_gradients():
    _run_fsdp_worker("cpu")


@pytest.mark.gpu
@cuda
def test_gpu_offload_then_fully_shard():
    _run_fsdp_worker("cuda")


def _fsdp_worker(device):
    """remat.apply(offload), then FSDP2 fully_shard (world size 1): parameters are DTensors between
    uses and FSDP2 frees their unsharded storages. On the CPU the engine runs inline (gloo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import workers
    from families import FAMILIES

    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    workers.init("nccl" if on_gpu else "gloo")
    model, make_inputs = FAMILIES["llama"]()
    inputs = {k: v.detach().to(device).requires_grad_(v.requires_grad) for k, v in make_inputs().items()}
    model.to(device)
    reference = copy.deepcopy(model)
    remat.apply(model, "offload", offload_options={"_inline": not on_gpu, "min_bytes": 0})
    mesh = init_device_mesh(device, (1,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    problems = []
    for _ in range(2):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            m(**inputs).loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.full_tensor() if p.grad is not None and hasattr(p.grad, "full_tensor") else p.grad
            if (grad is None) != (q.grad is None) or (grad is not None and not torch.equal(grad, q.grad)):
                problems.append(f"{name}: gradient differs")
    s = engine_of(model).stats()
    if not (s["bytes_d2h"] > 0 and s["tensors_kept_param"] > 0 and s["pinned_in_use_bytes"] == 0):
        problems.append(f"engine stats: {s}")
    dist.destroy_process_group()
    print("OK" if not problems else "\n".join(problems))


# -- 6. an offloaded model deep-copies and pickles ------------------------------------------------

def test_deepcopy_and_pickle_of_an_offloaded_model():
    model, _, engine = _pair(_inline=True)
    x = torch.randn(8, 32)
    expected = _grads(model, x)  # the engine has a pool, events and records behind it now
    loss = model(x).sum()  # a step in flight while the copies are taken
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.engine is not engine and clone.engine._model_ref is clone
        assert clone.engine.min_bytes == 0 and clone.engine._live == {}
        for ours, theirs in zip(_grads(clone, x), expected):
            assert torch.equal(ours, theirs)
        assert clone.engine.stats()["slots"] > 0 and engine.stats()["live_records"] > 0
    loss.backward()


def test_deepcopy_after_remat_apply_offload():
    model = _tiny()
    remat.apply(model, "offload", offload_options={"_inline": True, "min_bytes": 0})
    clone = copy.deepcopy(model)
    assert engine_of(clone)._model_ref is clone and engine_of(clone) is not engine_of(model)
    oracle.compare(clone, model, _ids()).assert_equal()
    assert engine_of(clone).stats()["slots"] > 0


# -- GPU: the in-place check with real streams ----------------------------------------------------

@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("settings", [{}, {"_delay": 2_000_000, "max_pending_bytes": 1 << 40},
                                      {"_delay": 2_000_000, "max_pending_bytes": 0}])
def test_gpu_inplace_write_to_a_saved_tensor_raises(settings):
    model, reference, engine = _pair(write=True, device="cuda")
    for key, value in settings.items():
        setattr(engine, key, value)
    x = torch.randn(64, 32, device="cuda")
    with pytest.raises(RuntimeError, match=INPLACE):
        _grads(reference, x)
    with pytest.raises(RuntimeError, match=INPLACE):
        _grads(model, x)
    torch.cuda.synchronize()
    clean, clean_reference, clean_engine = _pair(write=False, device="cuda")
    for key, value in settings.items():
        setattr(clean_engine, key, value)
    for ours, theirs in zip(_grads(clean, x), _grads(clean_reference, x)):
        assert torch.equal(ours, theirs)
    assert clean_engine.stats()["bytes_packed"] > 0


if __name__ == "__main__" and sys.argv[1:2] == ["fsdp"]:
    _fsdp_worker(sys.argv[2])
