"""The side-by-side proof: remat's plans and the stock strategies, one process, one batch.

Every strategy gets a freshly built model with the same seed (same weights) and the same
batch, and is measured with one protocol, the anchors' (docs/design/diagnosis.md): a step is
``zero_grad(set_to_none=True)``, ``loss = model(input_ids=ids, labels=ids).loss``,
``loss.backward()`` (the outputs are dropped before backward, as the HF Trainer does) and, with
``optimizer="adamw"``, ``torch.optim.AdamW``'s step; ``warmup`` steps, then the peaks over
``steps`` timed steps (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` after a
reset; :class:`~remat.prove.memtrack.PeakTracker` on the CPU) and the median step time with its
spread. Each record carries the planner's prediction beside the measurement, whether the first
loss (the untrained weights') equals eager's, and its fraction of the ceiling (the fastest
no-recompute row: :func:`relate_ceilings`).

On an emulated card (:mod:`remat.prove.card`) every row, planning included, runs with the
allocator capped at the card, except the rows named uncapped (ceilings that need more). A
strategy that does not apply is recorded with a reason (``skipped``); an out-of-memory is a
result (``oom``, with the phase it happened in and the peaks it reached), not a crash; the next
strategy starts from freed memory (the failed row's model is dropped with its traceback).

The rows are :mod:`remat.prove.strategies`: the stock strategies (anchors), the stacks users run
(:mod:`remat.prove.stacks`; a row's ``around`` scope is entered before its model is built),
remat's uniform specs and plans, eager and compiled. Compiled rows run last (a compile takes most
of a minute); each starts from the default ``activation_memory_budget`` and takes the graphs it compiled
back out of dynamo's cache (:mod:`remat.treat.dynamo_cache`), so no row inherits another's
compiler state and the process's other compiled graphs stay. A compiled row's record says whether
remat's attention-mask skip (:mod:`remat.treat.mask_skip`) was in force.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from remat.prove.card import Card, capped, peaks, uncapped
from remat.prove.anchors import Skip
from remat.prove.strategies import Strategy
from remat.treat import mask_skip
from remat.treat.dynamo_cache import own_compiles

GiB = 2 ** 30


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


OPTIMIZERS = {"none": None, "adamw": {}, "adamw-fused": {"fused": True}, "adamw-forloop": {"foreach": False}}
"""The bench's optimizers, by the names remat's planner takes (``remat.plan(optimizer=)``): the
``torch.optim.AdamW`` options of each. ``adamw`` is torch's default on a GPU (foreach: a step's
temporaries as large as a group of parameters), ``adamw-fused`` the Hugging Face Trainer's
default (``adamw_torch_fused``), ``adamw-forloop`` ``foreach=False``."""


def measure(build: Callable, strategy: Strategy, batch: dict, *, warmup=2, steps=5, optimizer: str = "none",
            model_type: str = "") -> dict:
    """Build a model, prepare it as ``strategy`` says, and measure peak bytes and step times.

    ``optimizer``: "none" (forward and backward) or a name in :data:`OPTIMIZERS` (``torch.optim.AdamW``
    over the trainable parameters, stepped after each backward; its state exists from the first
    warm-up step on).
    ``model_type``: the config's, handed to ``strategy.around`` (a Liger row's patch). An
    out-of-memory is a result: ``status`` "oom", ``phase`` (build, prepare: planning included,
    warmup or steps) and the peaks reached when it was raised."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    device = batch["input_ids"].device
    cuda = device.type == "cuda"
    record = {"strategy": strategy.name, "kind": strategy.kind}
    if optimizer != "none":
        record["optimizer"] = optimizer
    if strategy.budget_bytes is not None:
        record["budget_bytes"] = strategy.budget_bytes
    if strategy.compiled:
        record["compiled"] = True
    compiler_state = _compiler_state() if strategy.compiled else None
    where = {"phase": "build"}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with contextlib.ExitStack() as scope:
            if strategy.around is not None:
                scope.enter_context(strategy.around(model_type, cuda))
            _measure_row(build, strategy, batch, record, warmup, steps, optimizer, cuda, where)
    except Skip as e:
        record.update(status="skipped", reason=str(e))
    except ValueError as e:  # the planner's NoPlanFits, or a spec that does not apply
        record.update(status="skipped", reason=str(e)[:300])
    except torch.cuda.OutOfMemoryError as e:
        record.update(status="oom", reason=str(e).splitlines()[0][:200], phase=where["phase"])
        record.update({f"oom_{key}": value for key, value in peaks(cuda).items()})
    except Exception as e:  # one strategy failing must not lose the others' results
        record.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}", phase=where["phase"])
    finally:
        if compiler_state is not None:
            _restore_compiler(compiler_state)
        gc.collect()  # the traceback (and the model its frames held) is gone once the handler ended
        if cuda:
            torch.cuda.empty_cache()
    return record


def _measure_row(build, strategy, batch, record, warmup, steps, optimizer, cuda, where: dict) -> None:
    """The row's body: ``record`` filled in; ``where["phase"]`` says how far it got (build, prepare,
    warmup, steps), for the record of a row that raised. Its model is dropped when it returns or raises."""
    model = forward = opt = None
    try:
        model = build()
        if cuda:
            torch.cuda.synchronize()
        record["static_bytes"] = sum(t.numel() * t.element_size()
                                     for t in list(model.parameters()) + list(model.buffers()))
        where["phase"] = "prepare"
        forward, context, plan, *notes = strategy.prepare(model, batch)
        if strategy.compiled:
            record["mask_skip"] = bool(mask_skip.wrapped())
        for extra in notes:
            record.update(extra)
        if plan is not None:
            record.update(plan=plan.summary(), **{k: plan.notes[k] for k in
                                                 ("predicted_peak_bytes", "predicted_step_s", "peak_at", "verified")
                                                 if k in plan.notes})
        if OPTIMIZERS[optimizer] is not None:
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                    **OPTIMIZERS[optimizer])
        losses = []

        def one_step():
            model.zero_grad(set_to_none=True)
            loss = _step(forward, context, batch)
            if opt is not None:
                opt.step()
            if not losses:
                losses.append(loss)  # the untrained weights' loss: every row's first is comparable
            return loss
        where["phase"] = "warmup"
        start = time.perf_counter()
        for _ in range(warmup):  # a compiled row compiles here
            one_step()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        record["warmup_s"] = time.perf_counter() - start
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        where["phase"] = "steps"
        times, _ = timed_steps(one_step, steps, cuda=cuda)
        if cuda:
            record.update(peaks(cuda))
        else:  # no allocator statistics on the CPU: one more step, counted tensor by tensor
            from remat.prove.memtrack import PeakTracker
            model.zero_grad(set_to_none=True)
            with PeakTracker(baseline=list(model.parameters()) + list(model.buffers())) as tracker:
                one_step()
            record["peak_bytes"] = int(tracker.peak)
        tokens = batch["input_ids"].numel()
        median = statistics.median(times)
        record.update(status="ok", peak_GiB=record["peak_bytes"] / GiB, step_s=median,
                      step_s_min=min(times), step_s_max=max(times), tokens_per_s=tokens / median,
                      loss=float(losses[0]))
        if "reserved_peak_bytes" in record:
            record["reserved_GiB"] = record["reserved_peak_bytes"] / GiB
    finally:
        model = forward = opt = None


def _compiler_state() -> dict:
    """The knob rows set, saved, and from here the row's compiles are its own: a compiled row must
    not reuse another's graphs, and leaves none behind (:func:`remat.treat.dynamo_cache.own_compiles`)."""
    import torch._functorch.config as functorch_config
    scope = own_compiles("remat bench")
    scope.__enter__()
    return {"activation_memory_budget": functorch_config.activation_memory_budget, "scope": scope}


def _restore_compiler(state: dict) -> None:
    import torch._functorch.config as functorch_config
    state = dict(state)
    state.pop("scope").__exit__(None, None, None)
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
    if device.type == "cuda":
        info["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
        # the caching allocator's settings (expandable segments ...) decide what a card holds
        info["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    return info


def run(model_name: str, *, batch_size: int, seq: int, device: str, dtype, strategy_list: list,
        warmup=2, steps=5, progress=True, out_jsonl: Optional[str] = None, optimizer: str = "none",
        card: Optional[Card] = None, uncapped_rows=()) -> list:
    """Measure every strategy on one model and batch; returns the records (eager first).

    ``progress``: a stream for one line per strategy, True for ``sys.stderr`` as it is at the
    call (not at import: tests and notebooks replace it), or None. ``optimizer``: see
    :func:`measure`. ``card`` (:func:`remat.prove.card.parse_card`): every row runs with the
    allocator capped at the card, except those named in ``uncapped_rows`` (ceilings that do not
    fit the card), which run on the whole GPU; each record says which (``card_bytes``, None for
    the whole GPU) and the cap in force before is put back after each row."""
    if progress is True:
        progress = sys.stderr
    from remat.presets import build_model, load_config
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
    options = dict(warmup=warmup, steps=steps, optimizer=optimizer, model_type=getattr(config, "model_type", ""))
    for index, strategy in enumerate(strategy_list, 1):
        if progress:
            print(f"[{index}/{len(strategy_list)}] {strategy.name} ...", end="", file=progress, flush=True)
        on_card = card is not None and strategy.name not in uncapped_rows
        with capped(card) if on_card else uncapped(card):
            record = dict(shared, **measure(build, strategy, batch, **options))
        if card is not None:
            record["card_bytes"] = card.bytes if on_card else None
        _relate(record, records)
        records.append(record)
        if progress:
            print(" " + _one_line(record), file=progress, flush=True)
        if out_jsonl:
            with open(out_jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
    relate_ceilings(records)
    return records


def relate_all(records: list) -> None:
    """Recompute each record's comparison with eager and with its ceiling (after runs were merged)."""
    for index, record in enumerate(records):
        _relate(record, records[:index] + records[index + 1:])
    relate_ceilings(records)


EAGER_CEILINGS = ("liger_keep", "eager")
COMPILED_CEILINGS = ("compile_1", "compile_1+mask_skip")
"""No-recompute rows: a row's ceiling is the fastest of these that ran (compiled rows: of the compiled ones)."""


def ceiling_of(record: dict, records: list) -> Optional[dict]:
    """The ceiling ``record`` is a fraction of: the fastest ``ok`` row among :data:`COMPILED_CEILINGS`
    for a compiled row, :data:`EAGER_CEILINGS` for the others; None where none ran."""
    names = COMPILED_CEILINGS if record.get("compiled") else EAGER_CEILINGS
    ran = [r for r in records if r["strategy"] in names and r.get("status") == "ok"]
    return max(ran, key=lambda r: r["tokens_per_s"], default=None)


def relate_ceilings(records: list) -> None:
    """Each ``ok`` record's ``ceiling`` (its name) and ``vs_ceiling`` (tokens/s as a fraction of it)."""
    for record in records:
        ceiling = ceiling_of(record, records) if record.get("status") == "ok" else None
        if ceiling is not None:
            record.update(ceiling=ceiling["strategy"], vs_ceiling=record["tokens_per_s"] / ceiling["tokens_per_s"])


def _relate(record: dict, earlier: list) -> None:
    eager = next((r for r in earlier if r["strategy"] == "eager" and r.get("status") == "ok"), None)
    if eager is None or record.get("status") != "ok":
        return
    record["vs_eager"] = record["tokens_per_s"] / eager["tokens_per_s"]
    record["loss_equal_eager"] = record["loss"] == eager["loss"]
    record["loss_diff_eager"] = abs(record["loss"] - eager["loss"])


def _one_line(record: dict) -> str:
    if record.get("status") != "ok":
        where = f" in {record['phase']}" if record.get("phase") else ""
        return f"{record.get('status')}{where}: {record.get('reason', '')[:100]}"
    from remat.units import format_size
    text = f"{format_size(record['peak_bytes'])}"
    if "reserved_peak_bytes" in record:
        text += f" ({format_size(record['reserved_peak_bytes'])} reserved)"
    text += f", {record['tokens_per_s']:.0f} tok/s"
    if "vs_eager" in record:
        text += f" ({record['vs_eager']:.3f}x eager)"
    return text
