"""The side-by-side proof: remat's plans and the stock strategies, one process, one batch.

Every strategy gets a freshly built model with the same seed (same weights) and the same
batch, and is measured with one protocol, the one the anchors in DESIGN.md use: a step is
``zero_grad(set_to_none=True)``, ``loss = model(input_ids=ids, labels=ids).loss``,
``loss.backward()`` (the outputs are dropped before backward, as the HF Trainer does; no
optimizer step), ``warmup`` steps, then the peak over ``steps`` timed steps
(``torch.cuda.max_memory_allocated`` after a reset; :class:`~remat.prove.memtrack.PeakTracker`
on the CPU) and the median step time with its spread. Each record carries the planner's
prediction beside the measurement and whether the loss equals eager's.

A strategy that does not apply is recorded with a reason (``skipped``); an out-of-memory
is a result (``oom``), not a crash; the next strategy starts from freed memory.

Anchors: ``eager`` (no checkpointing), ``hf_full`` (HF gradient checkpointing,
non-reentrant), ``every2`` (``checkpoint_wrapper`` on every second layer), ``sac`` (HF
checkpointing with an op-level policy saving matmul and attention outputs),
``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``), ``hf_every2`` and
``hf_offload`` (transformers' own ``activation_checkpointing_enable(every_n_layers=2)`` /
``(offload=True)``; transformers 5.17 has the same arguments on ``gradient_checkpointing_enable``;
where neither is there the rows are skipped, saying so) and, optionally, ``compile_<b>``
(``torch.compile`` with ``activation_memory_budget=b``) and the field's fused losses on a
``keep`` model (``liger``: Liger's ``LigerFusedLinearCrossEntropyLoss``; ``cce``: Apple's
``cut_cross_entropy.linear_cross_entropy``; :mod:`remat.prove.anchors`), when they import.
remat rows: ``remat:<spec>`` (a uniform spec), ``remat@<budget>`` (the planner's plan for it)
and ``remat+compile@<budget>`` (``remat.plan(model, batch, budget, compile=True)``, applied,
then ``model.compile()``; the compile happens in the warm-up steps, whose time is recorded as
``warmup_s``), with ``compile_1+mask_skip`` before them: stock ``torch.compile`` with only
remat's attention-mask skip (:mod:`remat.treat.mask_skip`), to show what the plans add to it.
Compiled rows record ``mask_skip``: whether that skip was in force (never for the stock
``compile_<b>`` rows: every remat model of an earlier row has been freed by then).

Compiled rows run last (a compile takes most of a minute); each starts from
``torch._dynamo.reset()`` and the default ``activation_memory_budget``, and leaves both as
it found them, so no row inherits another's compiler state.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from remat.prove.anchors import Skip, fused_anchor, fused_loss_unavailable
from remat.treat import mask_skip

GiB = 2 ** 30


@dataclass(frozen=True)
class Strategy:
    """One row of the bench."""
    name: str
    kind: str  # "anchor" (a stock strategy) or "remat"
    prepare: Callable  # (model, batch) -> (forward, context manager factory, plan or None[, notes dict])
    budget_bytes: Optional[int] = None
    compiled: bool = False  # runs under torch.compile: the compiler state is reset around it


def _plain(model, batch):
    return model, contextlib.nullcontext, None


def _enable_hf(model, checkpoint_kwargs: dict) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # newer transformers: gradient_checkpointing_enable is a deprecated alias
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def _hf_full(model, batch):
    _enable_hf(model, {"use_reentrant": False})
    return model, contextlib.nullcontext, None


def hf_checkpointing(model):
    """transformers' own every-N / offload checkpointing on ``model``: ``(method, name of its
    kwargs argument)``, or raises :class:`Skip` saying why the installed transformers has none.

    ``activation_checkpointing_enable(every_n_layers=, offload=)`` where it exists; transformers
    5.17 has the same two arguments on ``gradient_checkpointing_enable`` (read from its source),
    older versions on neither."""
    method = getattr(model, "activation_checkpointing_enable", None)
    if callable(method):
        return method, "activation_checkpointing_kwargs"
    method = getattr(model, "gradient_checkpointing_enable", None)
    if callable(method) and {"every_n_layers", "offload"} <= set(inspect.signature(method).parameters):
        return method, "gradient_checkpointing_kwargs"
    try:
        import transformers
        version = f"transformers {transformers.__version__}"
    except ImportError:
        version = "this model"
    raise Skip(f"{version} has no activation_checkpointing_enable(every_n_layers=, offload=) "
                "(nor those arguments on gradient_checkpointing_enable)")


def _hf_native(every_n_layers: int = 1, offload: bool = False):
    def prepare(model, batch):
        method, kwargs_name = hf_checkpointing(model)
        if offload and next(model.parameters()).device.type != "cuda":
            raise Skip("offload moves activations to host memory: it only applies on a GPU")
        method(**{kwargs_name: {"use_reentrant": False}}, every_n_layers=every_n_layers, offload=offload)
        return model, contextlib.nullcontext, None, {"method": method.__name__}
    return prepare


def _hf_sac(model, batch):
    from remat.treat.selective import selective_context
    _enable_hf(model, {"use_reentrant": False, "context_fn": selective_context})
    return model, contextlib.nullcontext, None


def _every2(model, batch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from remat.treat.discovery import discover
    names = discover(model).block_names[::2]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, checkpoint_wrapper(getattr(parent, child),
                                                  checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model, contextlib.nullcontext, None


def _save_on_cpu(model, batch):
    if next(model.parameters()).device.type != "cuda":
        raise Skip("save_on_cpu moves activations to host memory: it only applies on a GPU")
    return model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True), None


def _compiled(budget: float, backend: Optional[str] = None):
    def prepare(model, batch):
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = budget  # measure() restores it afterwards
        return torch.compile(model, **_backend(backend)), contextlib.nullcontext, None
    return prepare


def _compiled_mask_skip(backend: Optional[str] = None):
    """Stock ``torch.compile`` (no plan, default memory budget) with remat's mask skip alone: how much
    of a compiled remat row's speed is :mod:`remat.treat.mask_skip` rather than its plan."""
    def prepare(model, batch):
        mask_skip.hold(model)
        return torch.compile(model, **_backend(backend)), contextlib.nullcontext, None
    return prepare


def _backend(backend: Optional[str]) -> dict:
    return {"backend": backend} if backend else {}


def _remat_spec(spec: str):
    def prepare(model, batch):
        import remat
        head = None
        if spec.endswith("+chunked"):
            spec_, head = spec[: -len("+chunked")], "chunked"
        else:
            spec_ = spec
        remat.apply(model, spec_, head=head)
        return model, contextlib.nullcontext, None
    return prepare


def _remat_budget(budget_bytes: int, gpu: Optional[str], profiles: dict, *, compile: bool = False,
                  backend: Optional[str] = None):
    """remat's plan for ``budget_bytes`` (``compile``: planned for, and run under, ``model.compile()``).
    One profile per batch shape and mode serves every budget: ``remat.plan(..., profiled=)``."""
    def prepare(model, batch):
        import remat
        kwargs = {"gpu": gpu} if gpu else {}
        key = (compile, tuple((k, tuple(v.shape)) for k, v in sorted(batch.items())))
        if key not in profiles:
            profiles[key] = remat.profile(model, batch, compile=compile, **kwargs)
        plan = remat.plan(model, batch, budget_bytes, compile=compile, profiled=profiles[key], **kwargs)
        remat.apply(model, plan)
        if compile:
            model.compile(**_backend(backend))  # in place: remat's wrappers stay visible to remat.remove
        return model, contextlib.nullcontext, plan
    return prepare


def strategies(budgets=(), *, uniform=("full", "selective"), compile_budgets=(), anchors=True,
               gpu: Optional[str] = None, compile_plans: bool = False, fused_anchors=(),
               compile_backend: Optional[str] = None) -> list:
    """The strategies to measure, in order. ``gpu`` names the rates the planner uses off-GPU.

    ``compile_plans``: a ``remat+compile@<budget>`` row per budget. ``fused_anchors``: names in
    :data:`remat.prove.anchors.FUSED_LOSSES`; one that does not import is refused here
    (ValueError saying what to install), before anything is measured. ``compile_backend``:
    ``torch.compile``'s backend for every compiled row (default inductor; ``aot_eager`` keeps
    CPU tests fast)."""
    for name in fused_anchors:
        why = fused_loss_unavailable(name)
        if why:
            raise ValueError(why)
    out = []
    if anchors:
        out += [Strategy("eager", "anchor", _plain), Strategy("hf_full", "anchor", _hf_full),
                Strategy("every2", "anchor", _every2), Strategy("sac", "anchor", _hf_sac),
                Strategy("save_on_cpu", "anchor", _save_on_cpu),
                Strategy("hf_every2", "anchor", _hf_native(every_n_layers=2)),
                Strategy("hf_offload", "anchor", _hf_native(offload=True))]
    out += [Strategy(f"remat:{spec}", "remat", _remat_spec(spec)) for spec in uniform]
    profiles = {}
    out += [Strategy(f"remat@{_fmt_gib(b)}", "remat", _remat_budget(b, gpu, profiles), budget_bytes=b)
            for b in budgets]
    out += [Strategy(name, "anchor", fused_anchor(name)) for name in fused_anchors]
    # last: a compile takes most of a minute, and the rest should not wait on it
    if anchors:
        out += [Strategy(f"compile_{b:g}", "anchor", _compiled(b, compile_backend), compiled=True)
                for b in compile_budgets]
    if compile_plans:
        out.append(Strategy("compile_1+mask_skip", "remat", _compiled_mask_skip(compile_backend), compiled=True))
        out += [Strategy(f"remat+compile@{_fmt_gib(b)}", "remat", _remat_budget(b, gpu, profiles, compile=True,
                                                                       backend=compile_backend),
                         budget_bytes=b, compiled=True) for b in budgets]
    return out


def _fmt_gib(n: int) -> str:
    from remat.units import format_size
    return format_size(n).replace(" ", "").replace(".00", "")


def _step(forward, context, batch):
    with context():
        loss = forward(**batch).loss
    loss.backward()
    return loss.detach()


def timed_steps(step: Callable, steps: int, *, cuda: bool = True):
    """Run ``step()`` ``steps`` times; returns (seconds of each, the last result). On CUDA
    the device is synchronised around each step, so host time is device time."""
    times, result = [], None
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, result


def measure(build: Callable, strategy: Strategy, batch: dict, *, warmup=2, steps=5) -> dict:
    """Build a model, prepare it as ``strategy`` says, and measure peak bytes and step times."""
    device = batch["input_ids"].device
    cuda = device.type == "cuda"
    record = {"strategy": strategy.name, "kind": strategy.kind}
    if strategy.budget_bytes is not None:
        record["budget_bytes"] = strategy.budget_bytes
    if strategy.compiled:
        record["compiled"] = True
    model = forward = None
    compiler_state = _compiler_state() if strategy.compiled else None
    try:
        model = build()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        record["static_bytes"] = sum(t.numel() * t.element_size()
                                     for t in list(model.parameters()) + list(model.buffers()))
        forward, context, plan, *notes = strategy.prepare(model, batch)
        if strategy.compiled:
            record["mask_skip"] = bool(mask_skip.wrapped())
        for extra in notes:
            record.update(extra)
        if plan is not None:
            record.update(plan=plan.summary(), **{k: plan.notes[k] for k in
                                                 ("predicted_peak_bytes", "predicted_step_s", "peak_at")
                                                 if k in plan.notes})
        first_loss = None
        start = time.perf_counter()
        for _ in range(warmup):  # a compiled row compiles here
            model.zero_grad(set_to_none=True)
            loss = _step(forward, context, batch)
            first_loss = loss if first_loss is None else first_loss
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        record["warmup_s"] = time.perf_counter() - start
        if cuda:
            torch.cuda.reset_peak_memory_stats()

        def one_step():
            model.zero_grad(set_to_none=True)
            return _step(forward, context, batch)
        times, loss = timed_steps(one_step, steps, cuda=cuda)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        else:  # no allocator statistics on the CPU: one more step, counted tensor by tensor
            from remat.prove.memtrack import PeakTracker
            model.zero_grad(set_to_none=True)
            with PeakTracker(baseline=list(model.parameters()) + list(model.buffers())) as tracker:
                _step(forward, context, batch)
            peak = tracker.peak
        tokens = batch["input_ids"].numel()
        median = statistics.median(times)
        record.update(status="ok", peak_bytes=int(peak), peak_GiB=peak / GiB, step_s=median,
                      step_s_min=min(times), step_s_max=max(times), tokens_per_s=tokens / median,
                      loss=float(first_loss if first_loss is not None else loss))
    except Skip as e:
        record.update(status="skipped", reason=str(e))
    except ValueError as e:  # the planner's NoPlanFits, or a spec that does not apply
        record.update(status="skipped", reason=str(e)[:300])
    except torch.cuda.OutOfMemoryError as e:
        record.update(status="oom", reason=str(e).splitlines()[0][:200])
    except Exception as e:  # one strategy failing must not lose the others' results
        record.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        del model, forward
        if compiler_state is not None:
            _restore_compiler(compiler_state)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return record


def _compiler_state() -> dict:
    """Reset dynamo (a compiled row must not reuse another's graphs) and save the knob rows set."""
    import torch._functorch.config as functorch_config
    torch._dynamo.reset()
    return {"activation_memory_budget": functorch_config.activation_memory_budget}


def _restore_compiler(state: dict) -> None:
    import torch._functorch.config as functorch_config
    torch._dynamo.reset()
    for key, value in state.items():
        setattr(functorch_config, key, value)


def environment(device: torch.device) -> dict:
    import remat
    info = {"torch": torch.__version__, "remat": remat.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device)}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return info


def run(model_name: str, *, batch_size: int, seq: int, device: str, dtype, strategy_list: list,
        warmup=2, steps=5, progress=True, out_jsonl: Optional[str] = None) -> list:
    """Measure every strategy on one model and batch; returns the records (eager first).

    ``progress``: a stream for one line per strategy, True for ``sys.stderr`` as it is at the
    call (not at import: tests and notebooks replace it), or None."""
    if progress is True:
        progress = sys.stderr
    from remat.integrations.presets import build_model, load_config
    config = load_config(model_name)
    dev = torch.device(device)
    env = environment(dev)
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=generator).to(dev)
    batch = {"input_ids": ids, "labels": ids}
    shared = dict(env, model=model_name, batch=batch_size, seq=seq, dtype=str(dtype).replace("torch.", ""))

    def build():
        return build_model(config, device=dev, dtype=dtype)

    records = []
    _run_all(strategy_list, build, batch, shared, records, warmup, steps, progress, out_jsonl)
    return records


def _run_all(strategy_list, build, batch, shared, records, warmup, steps, progress, out_jsonl):
    for index, strategy in enumerate(strategy_list, 1):
        if progress:
            print(f"[{index}/{len(strategy_list)}] {strategy.name} ...", end="", file=progress, flush=True)
        record = dict(shared, **measure(build, strategy, batch, warmup=warmup, steps=steps))
        _relate(record, records)
        records.append(record)
        if progress:
            print(" " + _one_line(record), file=progress, flush=True)
        if out_jsonl:
            with open(out_jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")


def relate_all(records: list) -> None:
    """Recompute each record's comparison with eager (after runs were merged)."""
    for index, record in enumerate(records):
        _relate(record, records[:index] + records[index + 1:])


def _relate(record: dict, earlier: list) -> None:
    eager = next((r for r in earlier if r["strategy"] == "eager" and r.get("status") == "ok"), None)
    if eager is None or record.get("status") != "ok":
        return
    record["vs_eager"] = record["tokens_per_s"] / eager["tokens_per_s"]
    record["loss_equal_eager"] = record["loss"] == eager["loss"]
    record["loss_diff_eager"] = abs(record["loss"] - eager["loss"])


def _one_line(record: dict) -> str:
    if record.get("status") != "ok":
        return f"{record.get('status')}: {record.get('reason', '')[:100]}"
    from remat.units import format_size
    text = f"{format_size(record['peak_bytes'])}, {record['tokens_per_s']:.0f} tok/s"
    if "vs_eager" in record:
        text += f" ({record['vs_eager']:.3f}x eager)"
    return text
