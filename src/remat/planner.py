"""``remat.plan`` and ``remat.auto``: profile, then solve, for a budget; ``auto`` also applies.

This module only joins :mod:`remat.profiling.profiler` (what each block costs),
:mod:`remat.planning.solver` (the fastest plan within the budget, checked by
:mod:`remat.planning.simulator`) and :func:`remat.apply`. The prediction rides along in
``plan.notes`` (peak, step time, what sets the peak, GPU, batch shape) so that ``remat bench`` /
``doctor`` can put the measurement beside it.

How it profiles: a model on the GPU is measured there (CUDA events, allocator statistics); any
other model (on the CPU, or on ``meta`` without weights) is profiled with fake tensors at the rates
of ``gpu`` (default h100), so a plan for an 80 GB card can be made on a laptop. Offload is only
planned where :mod:`remat.offload.engine` imports and the target is a GPU; the chunked head only
where :mod:`remat.head` reproduces the model's loss.

Compiled models: ``plan(..., compile=True)`` profiles each block class x treatment and the head as
``torch.compile`` runs them (:mod:`remat.profiling._compiled`), for ``remat.apply(model, plan);
model.compile()``. Compile changes the numbers a lot, so neither kind of plan transfers to the
other; ``plan.notes["compile"]`` says which it is. A compiled plan is run compiled before it is
returned and solved again if it peaked over the budget (:func:`verified`), needs the model on a
GPU, and never offloads (:data:`remat.profiling.OFFLOAD_UNDER_COMPILE`).

The budget is a card: the caching allocator reserves more than the peak it hands out, so a plan's
predicted peak is kept within the budget less :func:`allocator_reserve` (small with expandable
segments, a share of the activations without); ``notes["card_bytes"]`` is the smallest card it is
made for. Planning on the GPU measures inside the budget (:func:`remat.profiling.allocator_cap`),
and a budget larger than the card is planned for the card, and said. The reserve and margin
constants and where they were measured: docs/design/planning.md.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.nn as nn

from remat.planning.context import AttentionShape, context
from remat.planning.costs import Profile
from remat.planning.kernels import block_kernels, kernel_choices, kernel_options, plan_kernels, with_kernels
from remat.planning.plans import OFFLOADING_TREATMENTS, Plan
from remat.planning.replication import replicate
from remat.planning.sharding import shard
from remat.planning.solver import solve
from remat.profiling import allocator_cap, card_bytes, compile_scope, profile_scope
from remat.profiling.profiler import block_param_bytes
from remat.profiling.profiler import model_loss
from remat.profiling.profiler import profile as _profile
from remat.units import parse_budget


RESERVE_SHARE = 0.03
"""What a plan leaves of its budget for the caching allocator where expandable segments are on.
Not fitted; 0.5% was refuted on an H200, where a 16 GiB plan at 3% trained on a 16 GiB card (the
8B long-context plans are not yet run at a card of their budget; the runs: docs/design/planning.md,
benchmarks/results/issue38)."""
RESERVE_FLOOR = 64 * 2**20
"""The least a plan profiled on its GPU leaves for the caching allocator with expandable segments: a
small plan's reserve is not a share (an H200, a 595 MiB budget: the allocated peak was the predicted
574.7 MiB, the reserved peak 626 MiB, and 3% of the budget ran out of memory on its card). Not applied
to a fake profile's plan, whose budgets in tests are kilobytes."""
FRAGMENTATION_SHARE = 0.25
"""Where expandable segments cannot be had (:func:`remat.treat.allocator.expandable_possible`), the
share of the budget above static memory a plan leaves for the allocator's fragmentation (fixed-size
segments reserved up to 35% over a plan's activation bytes: docs/design/planning.md)."""

COMPILE_MARGIN = 0.03
"""A compiled plan is solved for its budget less this fraction of the budget above static memory:
after the compiled calibration (:mod:`remat.profiling._compiled`) mixed plans still peak a couple of
percent above their prediction, the whole graph keeping what no block alone does
(docs/design/planning.md)."""


def plan(model: nn.Module, batch, budget, *, loss_fn=None, gpu: Optional[str] = None, optimizer: str = "none",
         treatments: Optional[Sequence[str]] = None, heads: Optional[Sequence[str]] = None,
         blocks=None, fsdp_world: int = 1, device: Optional[str] = None, progress=None,
         compile=False, profiled: Optional[Profile] = None, ddp_world: int = 1, verify: bool = True,
         host_memory=None, cp_world: int = 1, cp_balance: bool = True, kernels=None) -> Plan:
    """The fastest plan for ``model`` training on ``batch`` whose predicted peak fits ``budget``.

    A block is left untouched, and the model's own head kept, unless changing it gains more than 1%
    of what it replaces or the budget needs it (:data:`remat.planning.solver.RECOMPUTE_MARGIN`). The
    model is profiled (:func:`remat.profile`; on its GPU where it is there, else with fake tensors at
    ``gpu``'s rates) and left exactly as it was found (an applied plan, gradients, buffers, RNG ...).

    Args:
        model: the ``nn.Module`` to train.
        batch: a tensor, a tuple/list or a dict of any keys, with the shapes of training. Values do not
            matter, but a batch a real step would crash on is refused before anything is profiled
            (token ids or labels outside the vocabulary, sequences past a position table: :func:`check_batch`).
        budget: the memory of one device, in bytes or as ``"24GiB"``; a budget above the card is
            planned for the card (warned). A plan's peak is kept below it less what the caching
            allocator reserves above its peak (:func:`allocator_reserve`).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, one training step's loss. Without it a dict
            batch is a Hugging Face model's, ``model(**batch).loss`` (``labels`` default to ``input_ids``),
            and a tensor of integer ids a causal LM's trained on them (``labels=ids``). A model with no LM
            head plans with the plain head only.
        gpu: the rates to plan for when the model is not on a GPU (h100, h200, a100).
        optimizer: ``"none"`` (forward and backward only, as ``remat bench``), ``"adamw"`` (two states per
            trainable parameter in its dtype, as ``torch.optim.AdamW``), ``"adamw-fused"``,
            ``"adamw-forloop"`` or ``"adamw8bit"``.
        treatments: the treatments a plan may use (default: every one profiled, less offload where it
            cannot run: a CPU, no offload engine, a compiled plan).
        heads: the head modes a plan may use (default: every one profiled).
        blocks: which modules are the blocks (default: :func:`remat.treat.discovery.discover`'s).
        fsdp_world: plan for one of that many FSDP2 ranks (``fully_shard`` after ``remat.apply``:
            :mod:`remat.planning.sharding`).
        device: ``"fake"`` profiles a GPU model with fake tensors (no GPU memory used, roofline times);
            default: measured on the GPU when the model is there.
        progress: ``progress(message)``, told each stage as it starts (``remat.profiling.profiler.progress_printer``).
        compile: plan for the model compiled after ``remat.apply`` (``True``: ``model.compile()`` or
            ``torch.compile(model)``; ``"blocks"``: ``block.compile()`` on every block, the embeddings
            and head eager, as FSDP2 is compiled before ``fully_shard``): costs measured compiled, on the
            GPU only, no offload; ``notes["compile"]`` and ``notes["compile_scope"]`` say so. remat's
            own compiles are taken back out of dynamo's cache when measured and only they
            (:mod:`remat.treat.dynamo_cache`), so your ``model.compile()`` starts clean.
        profiled: a :func:`remat.profile` of this model and batch shape made earlier (with the same
            ``compile``, ``optimizer`` and ``kernels``): solved for ``budget`` without profiling again,
            so one profile serves many budgets (under ``cp_world``: a profile of one rank's share).
        ddp_world: plan for one of that many ``DistributedDataParallel`` ranks (wrapped after
            ``remat.apply``, DDP's default arguments: :mod:`remat.planning.replication`).
        verify: for a compiled plan, apply, compile and run it for four steps on this GPU before it is
            returned (tens of seconds), and solve again if it peaked over the budget (:func:`verified`;
            ``notes["verified"]``); False: the prediction alone. Plans for several ranks are not measured.
        host_memory: the pinned host memory offloaded tensors may take (bytes or ``"100GiB"``); default,
            for a profile measured on this machine's GPU, what the offload engine's pool takes here
            (60% of the available memory, divided among the ranks torchrun started on this host), and
            no limit for a fake-tensor profile, made for another machine. ``notes["host_bytes"]`` says
            how much a plan pins.
        cp_world: plan for one of that many context-parallel ranks splitting each sequence
            (:mod:`remat.parallel`): the model profiled on one rank's ``seq / cp_world`` tokens and each
            block charged the attention over the rest of the sequence, its exchange and buffers
            (:mod:`remat.planning.context`); with ``fsdp_world``, parameters, gradients and optimizer
            state sharded over that many ranks. The model must run attention through SDPA.
        cp_balance: the sequence is cut head-tail (every rank an equal share of attention, as
            :func:`remat.parallel.shard_sequence` and torch's ``context_parallel`` cut it), or, False,
            into contiguous pieces (the last rank's share, the largest, is charged).
        kernels: None (the model's modules as they are; a model liger-kernel patched is measured with
            its kernels), ``"stock"``, ``"liger"`` (liger-kernel's fused norms, gated MLP and rotary
            embedding per block, installed by :func:`remat.apply`, and Liger's fused loss among the head
            modes) or ``("stock", "liger")``: both profiled, the fastest chosen per block class
            (:mod:`remat.planning.kernels`); the plan's ``kernels`` records them.

    Returns:
        A :class:`~remat.planning.plans.Plan`: a treatment per block, the head mode and chunk, the
        tiled blocks' chunk (``plan.tile_tokens``), and in ``plan.notes`` the prediction (peak, step
        time, where the peak is set, GPU, batch shape) and how it was made (``card_bytes``: the
        smallest card it is made for; ``host_bytes``, ``compile``, ``verified``, ``kernels_stock``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; a batch whose loss cannot be told without ``loss_fn``.
        ValueError: a batch a real step would crash on; a bad budget; ``cp_world`` not a whole number,
            with ``ddp_world``, a model without SDPA attention or a sequence that does not divide by
            ``2 x cp_world`` (``cp_world`` with ``cp_balance=False``); ``fsdp_world`` with
            ``ddp_world``; offload treatments with ``compile``; a ``profiled`` made with another
            ``compile`` or without the ``kernels`` asked; ``compile`` for a model off the GPU;
            ``kernels="liger"`` without liger-kernel (``pip install remat[kernels]``) and ``"stock"`` on a
            model liger-kernel patched; and everything :func:`remat.profile` raises.
        remat.NoPlanFits: nothing fits the budget (a ValueError); its message and ``smallest_peak``
            name the smallest budget that fits, with that ``plan``, or the host's pinned memory as the limit.

    Example:
        >>> ids = torch.randint(0, model.config.vocab_size, (4, 4096))   # doctest: +SKIP
        >>> chosen = remat.plan(model, {"input_ids": ids}, "24GiB")     # doctest: +SKIP
        >>> chosen.summary(), chosen.notes["predicted_peak_bytes"]      # doctest: +SKIP
        >>> remat.apply(model, chosen)                                  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.plan expects a torch.nn.Module as its first argument, got {type(model).__name__} "
                        f"({_short(model)}); call remat.plan(model, batch, budget=...) with the model object")
    budget_bytes = parse_budget(budget)
    check_batch(model, batch, labels=loss_fn is None)
    on_gpu = _measured_on_gpu(model, device)
    budget_bytes = within_card(budget_bytes, model if on_gpu else None, gpu)
    shape = _context_shape(model, cp_world, ddp_world)
    if cp_world != 1 and profiled is None:
        batch = cp_piece(model, batch, cp_world, balance=cp_balance)
    if fsdp_world != 1 and ddp_world != 1:
        raise ValueError(f"fsdp_world={fsdp_world!r} and ddp_world={ddp_world!r}: a model is either sharded (FSDP2) or "
                         "replicated (DDP) over its ranks, not both; pass one of them (HSDP is not modelled)")
    scope = compile_scope(compile)
    _check_reuse(scope, compile=compile, treatments=treatments, profiled=profiled, kernels=kernels)
    with _within_budget(model, budget_bytes, on_gpu and profiled is None):
        prof = profiled or _profile(model, batch, loss_fn=loss_fn, gpu=gpu, device=device, optimizer=optimizer,
                                    blocks=blocks, progress=progress, compile=compile, kernels=kernels)
    prof = replace(prof, host_limit=_host_limit(prof, host_memory))
    prof = _ranked(model, prof, budget_bytes, treatments=treatments, heads=heads, shape=shape, cp_world=cp_world,
                   cp_balance=cp_balance, fsdp_world=fsdp_world, ddp_world=ddp_world)
    allowed = allowed_treatments(prof, treatments)
    if not (scope and verify):
        return solve_profiled(prof, budget_bytes, treatments=allowed, heads=heads)
    if fsdp_world != 1 or ddp_world != 1 or cp_world != 1:
        return _noted(solve_profiled(prof, budget_bytes, treatments=allowed, heads=heads),
                      f"not measured: planned for one of {max(fsdp_world, ddp_world, cp_world)} ranks, which one "
                      "GPU alone does not run")
    with _within_budget(model, budget_bytes, on_gpu):
        return verified(model, batch, prof, budget_bytes, loss_fn=loss_fn, treatments=allowed, heads=heads,
                        blocks=blocks, progress=progress)


def _context_shape(model: nn.Module, cp_world, ddp_world: int) -> Optional[AttentionShape]:
    """:func:`plan`'s ``cp_world`` checked (a whole number, not with ``ddp_world``), and the attention a
    context-parallel rank exchanges (None without context parallelism)."""
    if isinstance(cp_world, bool) or not isinstance(cp_world, int) or cp_world < 1:
        raise ValueError(f"cp_world must be a whole number >= 1 (ranks splitting each sequence), got {cp_world!r}")
    if cp_world == 1:
        return None
    if ddp_world != 1:
        raise ValueError(f"cp_world={cp_world} with ddp_world={ddp_world} is not modelled: shard the model over "
                         "the ranks with fsdp_world instead (as torchtitan does under context parallelism)")
    return attention_shape(model)


def _check_reuse(scope, *, compile, treatments, profiled, kernels) -> None:
    """What :func:`plan` refuses of its compile, treatments and ``profiled`` before profiling: offload
    treatments under compile, a profile made with another compile scope or without the kernels asked."""
    if scope and treatments is not None:
        offloading = [t for t in treatments if t in OFFLOADING_TREATMENTS]
        if offloading:
            from remat.profiling import OFFLOAD_UNDER_COMPILE
            raise ValueError(f"treatments {offloading} cannot be planned with compile=True: {OFFLOAD_UNDER_COMPILE}; "
                             "leave them out, or plan without compile=True")
    if profiled is not None and profile_scope(profiled.notes) != scope:
        made = {None: False, "model": True}.get(profile_scope(profiled.notes), profile_scope(profiled.notes))
        raise ValueError(f"profiled was made with compile={made!r}, but compile={compile!r} was asked: profile "
                         f"again with remat.profile(..., compile={compile!r})")
    if profiled is not None and kernel_options(kernels) and not profiled.kernel_variants:
        raise ValueError(f"kernels={kernels!r} with profiled=: that profile was made without kernels; profile "
                         f"again with remat.profile(..., kernels={kernels!r})")


def _host_limit(prof: Profile, host_memory) -> Optional[int]:
    """The pinned host bytes a plan of ``prof`` may offload: ``host_memory`` where given, else this host's
    share when the profile was measured here on its GPU, else unknown (a plan made on a laptop for an
    H100 box must not take the laptop's memory)."""
    if host_memory is not None:
        return parse_budget(host_memory)
    return host_share(default_host_limit()) if prof.device == "cuda" else None


def _ranked(model: nn.Module, prof: Profile, budget_bytes: int, *, treatments, heads, shape, cp_world: int,
            cp_balance: bool, fsdp_world: int, ddp_world: int) -> Profile:
    """``prof`` as one rank trains it (context-parallel, FSDP2-sharded, DDP-replicated as asked), for
    the kernels whose plan within ``budget_bytes`` is fastest where it was profiled with several."""
    candidates = []
    for choice in kernel_choices(prof):   # one, unless profiled with several kernels
        candidate = with_kernels(prof, choice)
        if cp_world != 1:
            candidate = context(candidate, cp_world, shape, balance=cp_balance)
        if fsdp_world != 1:
            candidate = shard(candidate, fsdp_world, block_param_bytes(model, candidate))
        if ddp_world != 1:
            candidate = replicated(candidate, model, ddp_world)
        candidates.append(candidate)
    return fastest_kernels(candidates, budget_bytes, treatments, heads)


def _measured_on_gpu(model: nn.Module, device: Optional[str]) -> bool:
    """Whether :func:`plan` measures ``model`` on its GPU (not with fake tensors)."""
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cuda" and device != "fake"


@contextlib.contextmanager
def _within_budget(model: nn.Module, budget_bytes: int, on_gpu: bool):
    """Planning's own allocations capped at the budget on the model's GPU, in expandable segments
    (:func:`remat.treat.allocator.while_planning`); a no-op off the GPU."""
    if not on_gpu:
        yield
        return
    from remat.planning.solver import NoPlanFits
    from remat.treat.allocator import while_planning
    from remat.units import format_size
    device = next(model.parameters()).device
    held = torch.cuda.memory_allocated(device)
    if held >= budget_bytes:   # planning inside the budget could not even start: say so, not a CUDA OOM
        raise NoPlanFits(f"this process already holds {format_size(held)} on {device} (the model's parameters and "
                         f"anything else allocated), at or over the budget of {format_size(budget_bytes)}: raise "
                         "the budget, or free what else is on the GPU (another model, a reference copy, "
                         "cached tensors) before planning")
    with while_planning(), allocator_cap(device, budget_bytes):
        yield


def within_card(budget_bytes: int, model: Optional[nn.Module] = None, gpu: Optional[str] = None) -> int:
    """``budget_bytes``, or the card's memory where the budget is larger (warned): the memory this process
    may hold on ``model``'s GPU (a model measured there), else the card ``gpu`` names (a plan made with
    fake tensors for it); a budget is kept as given where neither is known."""
    from remat.planning.costs import CARD_BYTES
    from remat.units import format_size
    if model is not None:
        card, what = card_bytes(next(model.parameters()).device), "this process can hold on this GPU"
    else:
        key = next((k for k in CARD_BYTES if gpu and k in str(gpu).lower()), None)
        if key is None:
            return budget_bytes
        card, what = CARD_BYTES[key], f"an {key.upper()} holds"
    if budget_bytes <= card:
        return budget_bytes
    warnings.warn(f"remat: the budget {format_size(budget_bytes)} is more than {what} ({format_size(card)}); "
                  f"planning for {format_size(card)}", UserWarning, stacklevel=3)
    return card


def allocator_reserve(prof: Profile, budget_bytes: int) -> tuple:
    """``(bytes, how)``: what a plan of ``prof`` leaves of ``budget_bytes`` for the caching allocator's
    reserve above its allocated peak, and a sentence on why (see the module doc): :data:`RESERVE_SHARE`
    of the budget with expandable segments, :data:`FRAGMENTATION_SHARE` of the budget above static
    memory without them; nothing for a plan that runs on a CPU."""
    from remat.treat.allocator import expandable_possible
    if prof.rates.name == "cpu":
        return 0, "a CPU has no caching allocator to reserve for"
    why = expandable_possible()
    if why is None:
        share = int(RESERVE_SHARE * budget_bytes)
        if prof.device == "cuda" and share < RESERVE_FLOOR:
            return RESERVE_FLOOR, f"expandable segments (remat.apply switches them on), at least " \
                                  f"{RESERVE_FLOOR // 2**20} MiB"
        return share, "expandable segments (remat.apply switches them on)"
    share = int(FRAGMENTATION_SHARE * max(0, budget_bytes - prof.static_bytes))
    return share, f"fixed-size segments ({why}): {FRAGMENTATION_SHARE:.0%} of the budget above static memory kept " \
                  "for their fragmentation"


POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions", "position_embedding", "positional_embedding",
                   "positions_embed", "pos_emb", "pos_embed")
"""Last names of the modules that hold a model's learned (or fixed sinusoidal) position table, read
by :func:`position_limit`: GPT-2's ``wpe``, BERT's and RoBERTa's ``position_embeddings``, OPT's,
BART's and Marian's ``embed_positions``, GPT-1's ``positions_embed``, CLIP text's
``position_embedding``."""
POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx", "max_target_positions")
"""Config fields that state a position table's size (GPT-2: ``n_positions``; most others
``max_position_embeddings``). A field alone limits nothing: RoPE and ALiBi models declare
``max_position_embeddings`` and run past it (it only scales RoPE), so a limit needs a table too."""


def position_limit(model: nn.Module) -> Optional[tuple]:
    """``(positions, where)``: how many positions ``model``'s position table holds and a phrase
    naming it (``"transformer.wpe: n_positions 1024"``), or None where nothing limits the length.

    A limit is an ``nn.Embedding`` named as :data:`POSITION_TABLES` lists whose size equals a
    :data:`POSITION_FIELDS` field of the model's config (or its ``text_config``): both agree that
    the model has that many rows. The positions are the rows less those a sequence cannot reach:
    the offset OPT and BART add (they start at 2), and a RoBERTa-style table's padding row and
    those below it (positions start after ``padding_idx``: 514 rows hold 512). A rotary or ALiBi
    model has no such table and is never limited, whatever its config declares (a sweep of
    transformers' causal, masked and seq2seq LMs finds one in GPT-2, GPT-Neo, OPT, BioGPT, BERT and
    RoBERTa kin, BART kin, Marian, Pegasus, Whisper's decoder, XLM, RoFormer, and none in Llama,
    Mistral, Qwen, Gemma, GPT-J, BLOOM, MPT, T5, Mamba)."""
    config = getattr(model, "config", None)
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
    declared = {}
    for c in configs:
        for field in POSITION_FIELDS:
            value = getattr(c, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                declared.setdefault(value, field)
    if not declared:
        return None
    for name, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or name.rsplit(".", 1)[-1] not in POSITION_TABLES:
            continue
        offset = getattr(module, "offset", 0)
        offset = offset if isinstance(offset, int) else 0
        rows = module.num_embeddings
        padding = module.padding_idx + 1 if module.padding_idx is not None and module.padding_idx >= 0 else 0
        if offset and rows - offset in declared:  # the config counts positions, the table adds its offset (OPT, BART)
            return rows - offset, f"{name}: {declared[rows - offset]} {rows - offset:,}"
        if rows in declared:  # the config counts rows, a padding row among them (RoBERTa: 514 rows, 512 positions)
            return rows - offset - padding, f"{name}: {declared[rows]} {rows:,}" + (
                f", positions from {offset + padding}" if offset + padding else "")
    return None


LENGTH_KEYS = ("input_ids", "inputs_embeds", "decoder_input_ids", "labels")
"""The batch entries whose second dimension is a sequence of positions (:func:`check_batch`)."""


def check_batch(model: nn.Module, batch, *, labels: bool = True) -> None:
    """Refuse, before anything is profiled, a batch a real training step of ``model`` would crash
    on: a sequence longer than the model's position table (:func:`position_limit`), a token id
    outside its input embeddings, and with ``labels`` (the model's own loss: no ``loss_fn``, whose
    labels may mean something else) a label outside its output embeddings (``-100``, ignored, is
    fine). Values are read only from real tensors (a batch on the meta device has none); a
    ValueError names the entry, what it holds, the limit and what to pass."""
    entries = {"input_ids": batch} if isinstance(batch, torch.Tensor) and not batch.is_floating_point() else (
        batch if isinstance(batch, dict) else {})
    limit = position_limit(model)
    if limit is not None:
        positions, where = limit
        for key in LENGTH_KEYS:
            value = entries.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] > positions:
                raise ValueError(f"{key} holds sequences of {value.shape[1]:,} tokens, longer than the "
                                 f"{positions:,} positions {type(model).__name__} has ({where}); a training step "
                                 f"would fail in its position embedding. Pass sequences of at most {positions:,} "
                                 "tokens, or a config with a larger position table")
    tables = {"input_ids": _embedding_rows(model, "input"), "decoder_input_ids": _embedding_rows(model, "input"),
              "labels": _embedding_rows(model, "output") if labels else None}
    for key, rows in tables.items():
        value = entries.get(key)
        if rows is None or not _has_values(value) or value.is_floating_point() or value.numel() == 0:
            continue
        held = value[value != -100] if key == "labels" else value
        if held.numel() and (int(held.max()) >= rows or int(held.min()) < 0):
            bad = int(held.max()) if int(held.max()) >= rows else int(held.min())
            raise ValueError(f"{key} holds the token id {bad:,}, outside {type(model).__name__}'s vocabulary of "
                             f"{rows:,} ids (0 to {rows - 1:,}); a training step would fail in its "
                             f"{'embedding' if key != 'labels' else 'loss'}. Tokenize with this model's tokenizer, "
                             "or resize its embeddings (model.resize_token_embeddings(len(tokenizer)))"
                             + ("; labels ignored by the loss are -100" if key == "labels" else ""))


def _embedding_rows(model: nn.Module, side: str) -> Optional[int]:
    """Rows of a Hugging Face model's input embeddings (``side="input"``) or output ones (None elsewhere)."""
    getter = getattr(model, f"get_{side}_embeddings", None)
    try:
        module = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError, TypeError):
        return None
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _has_values(value) -> bool:
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return False
    from torch._subclasses.fake_tensor import is_fake
    return not is_fake(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def solve_profiled(prof: Profile, budget_bytes: int, *, treatments=None, heads=None, held_back: int = 0) -> Plan:
    """The fastest plan for ``prof`` within ``budget_bytes``, as :func:`plan` solves it: a compiled
    profile is solved for the budget less :data:`COMPILE_MARGIN` of what lies above static memory
    and less ``held_back`` (what :func:`verified` measured a plan over by); ``notes["budget_bytes"]``
    stays the budget asked, ``notes["compile_margin_bytes"]`` says how much was kept back, and the
    plan is marked ``notes["compile"]``. For callers that hold a profile already (``remat plan``,
    the FSDP bench). Raises :class:`remat.NoPlanFits`."""
    from remat.planning.solver import NoPlanFits
    from remat.units import format_size
    compiled = int(COMPILE_MARGIN * max(0, budget_bytes - prof.static_bytes)) if prof.notes.get("compile") else 0
    margin = compiled + held_back
    reserve, how = allocator_reserve(prof, budget_bytes)
    try:
        chosen = solve(prof, budget_bytes - margin - reserve, treatments=treatments, heads=heads)
    except NoPlanFits as e:
        if prof.rates.name == "cpu" or e.smallest_peak is None or e.host_limited:
            raise   # a CPU plan keeps nothing back: the solver's smallest budget is the user's
        # the budget a user must give: the smallest peak plus what the allocator reserves on top of it
        if how.startswith("expandable"):
            need = int((e.smallest_peak + margin) / (1 - RESERVE_SHARE)) + 1
            if prof.device == "cuda":
                need = max(need, e.smallest_peak + margin + RESERVE_FLOOR + 1)
        else:
            need = int((e.smallest_peak + margin - FRAGMENTATION_SHARE * prof.static_bytes)
                       / (1 - FRAGMENTATION_SHARE)) + 1
        summary = f"{e.plan.summary()}: predicted peak {format_size(e.plan.notes['predicted_peak_bytes'])}, set in " \
            f"{e.plan.notes.get('peak_at')}" if e.plan is not None else "no plan"
        raise NoPlanFits(f"no plan fits {format_size(budget_bytes)} with {format_size(reserve)} of it kept for the "
                         f"caching allocator ({how}): the smallest budget that fits is {format_size(need)} "
                         f"({summary}). Raise the budget to at least {format_size(need)}, "
                         "shorten the batch or sequence, or free static memory (static alone is "
                         f"{format_size(prof.static_bytes)}).", need, e.plan) from None
    notes = dict(chosen.notes, budget_bytes=budget_bytes)
    if margin:
        notes["compile_margin_bytes"] = margin
    if reserve:
        notes.update(allocator=how, allocator_reserve_bytes=reserve,
                     card_bytes=int(chosen.notes["predicted_peak_bytes"] + reserve))
    return _marked(replace(chosen, notes=notes), prof)


VERIFY_TRIES = 3
"""Compiled steps :func:`verified` measures at most, each of a plan solved again after the one
before it peaked over the budget."""
VERIFY_SLACK = 0.01
"""Held back beyond a measured excess when solving again, as a fraction of the budget above
static memory: the next plan differs, and so may what the whole compiled graph keeps around it."""


def verified(model: nn.Module, batch, prof: Profile, budget_bytes: int, *, loss_fn=None, treatments=None,
             heads=None, blocks=None, progress=None, measure=None) -> Plan:
    """:func:`solve_profiled`, then, for a compiled profile, the plan measured on a compiled step of
    ``model`` (:mod:`remat.profiling._verify`): a plan that peaks over ``budget_bytes`` is solved
    again with its excess (plus :data:`VERIFY_SLACK`) held back, and that plan measured, up to
    :data:`VERIFY_TRIES` plans. The plan returned has ``notes["verified"]``: its measured
    ``peak_bytes`` and ``step_s`` and every plan ``tries`` measured, or a string saying why it
    was not measured (a plan that does not fit in the GPU's free memory now, a model off the GPU).
    Raises :class:`remat.NoPlanFits` when every plan tried peaked over the budget (its
    ``smallest_peak``: the lowest measured, with that ``plan``) or nothing fits after holding back,
    and ``torch.OutOfMemoryError`` from a step that ran out of memory; any other error of the
    step (a model dynamo cannot compile whole, say) is warned and the plan returned unmeasured.
    ``measure(plan) -> {"peak_bytes", "step_s"}`` stands in for the compiled step (tests)."""
    from remat.planning.solver import NoPlanFits
    from remat.units import format_size
    chosen = solve_profiled(prof, budget_bytes, treatments=treatments, heads=heads)
    if not prof.notes.get("compile"):
        return chosen
    if measure is None:
        from remat.api import apply
        from remat.profiling import measure_compiled, room_to_measure
        why = room_to_measure(model, prof, chosen)
        if why:
            return _noted(chosen, f"not measured: {why}")
        batch, loss_fn = model_loss(batch, loss_fn)

        def measure(candidate):
            return measure_compiled(model, batch, loss_fn, candidate, prof, apply_plan=apply, blocks=blocks)
    say = progress or (lambda message: None)
    slack = int(VERIFY_SLACK * max(0, budget_bytes - prof.static_bytes))
    tries, plans, held_back = [], [], 0
    for _ in range(VERIFY_TRIES):
        say(f"measuring the plan on a compiled step: {chosen.summary()}")
        try:
            measured = measure(chosen)
        except torch.OutOfMemoryError:  # the plan does not run on this GPU: the user must know
            raise
        except (RuntimeError, ValueError, TypeError, AttributeError) as e:  # as the calibration: the plan stands
            warnings.warn(f"remat: the compiled plan could not be measured ({type(e).__name__}: {str(e)[:200]}); "
                          "returned on its prediction alone", stacklevel=3)
            return _noted(chosen, f"not measured: {type(e).__name__}: {str(e)[:200]}")
        plans.append(chosen)
        tries.append(dict(plan=chosen.summary(), predicted_peak_bytes=chosen.notes["predicted_peak_bytes"], **measured))
        if measured["peak_bytes"] <= budget_bytes:
            return _noted(chosen, dict(measured, tries=tries))
        held_back += measured["peak_bytes"] - budget_bytes + slack
        say(f"it peaked at {format_size(measured['peak_bytes'])}, over the {format_size(budget_bytes)} budget "
            f"(predicted {format_size(chosen.notes['predicted_peak_bytes'])}): solving again with "
            f"{format_size(held_back)} more held back")
        try:
            chosen = solve_profiled(prof, budget_bytes, treatments=treatments, heads=heads, held_back=held_back)
        except NoPlanFits as e:
            raise NoPlanFits(f"{_over(tries, budget_bytes)}; with that held back, {e}", e.smallest_peak,
                             e.plan) from None
    lowest = min(range(len(tries)), key=lambda i: tries[i]["peak_bytes"])
    peak = tries[lowest]["peak_bytes"]
    raise NoPlanFits(f"{_over(tries, budget_bytes)}. The lowest measured peak was {format_size(peak)} "
                     f"({tries[lowest]['plan']}): plan for a budget above it, or without compile", peak,
                     _noted(plans[lowest], dict(tries[lowest], tries=tries)))


def _over(tries: list, budget_bytes: int) -> str:
    from remat.units import format_size as f
    return (f"compiled plans measured over the {f(budget_bytes)} budget: "
            + "; ".join(f"{t['plan']} peaked {f(t['peak_bytes'])} (predicted {f(t['predicted_peak_bytes'])})"
                        for t in tries))


def _noted(chosen: Plan, verified_note) -> Plan:
    return replace(chosen, notes=dict(chosen.notes, verified=verified_note))


def cp_piece(model: nn.Module, batch, world: int, *, balance: bool = True):
    """What one of ``world`` context-parallel ranks computes of ``batch``: the first ``seq / world``
    tokens of every tensor whose second dimension is the sequence (the shapes, and so the costs, of
    any rank's share in either layout; its attention over the rest is
    :mod:`remat.planning.context`'s). Checks what :func:`remat.parallel.shard_sequence` will refuse
    with that ``balance`` (ValueError), and the model's attention."""
    from remat.parallel.sequence import check_batch, check_model
    check_model(model)
    whole = {"input_ids": batch} if isinstance(batch, torch.Tensor) else batch
    if not isinstance(whole, dict):
        raise TypeError(f"cp_world plans a causal LM's batch: token ids or a dict of them, got {type(batch).__name__}")
    _, length = check_batch(whole, world, balance=balance)
    piece = {k: v[:, :length // world] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length
             else v for k, v in whole.items() if k != "attention_mask"}
    return piece["input_ids"] if isinstance(batch, torch.Tensor) else piece


def attention_shape(model: nn.Module) -> AttentionShape:
    """The attention a context-parallel rank exchanges, from ``model``'s Hugging Face (text) config:
    heads, key/value heads, head size; ValueError for a model without one."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"cp_world needs the attention's shape, read from a Hugging Face config "
                         f"(num_attention_heads ...); {type(model).__name__} has none")
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return AttentionShape(heads=int(heads), kv_heads=int(kv), head_dim=int(head_dim),
                          value_dim=getattr(text, "v_head_dim", None))


def replicated(prof: Profile, model: nn.Module, world: int) -> Profile:
    """``prof`` as one of ``world`` DDP ranks of ``model`` sees it: its trainable gradients bucketed
    as DDP buckets them (:func:`remat.planning.replication.replicate`)."""
    stream = gradient_stream(model, prof)
    per_class, total = _grad_bytes(prof, stream)
    return replicate(prof, world, class_grad_bytes=per_class, grad_bytes=total, stream=stream)


def gradient_stream(model: nn.Module, prof) -> tuple:
    """``(owner, gradient bytes)`` of every trainable parameter in backward order (the reverse of
    registration), a shared one once where it is registered first; owner: the index of the block
    that holds it, ``"embeddings"`` for the root's registered before the first block, ``"head"``
    for those after (final norm, LM head)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    block_of = {}
    for index, name in enumerate(prof.block_names):
        for p in modules[name].parameters():
            block_of.setdefault(id(p), index)
    forward, seen_block = [], False
    for p in model.parameters():  # registration order, shared parameters once
        owner = block_of.get(id(p))
        seen_block = seen_block or owner is not None
        if p.requires_grad:
            forward.append((owner if owner is not None else ("head" if seen_block else "embeddings"),
                            p.numel() * p.element_size()))
    return tuple(reversed(forward))


def trainable_grad_bytes(model: nn.Module, prof) -> tuple:
    """(per block class, one block's trainable gradient bytes; the whole model's), what DDP buckets
    (:func:`remat.planning.replication.replicate`); shared parameters counted once."""
    return _grad_bytes(prof, gradient_stream(model, prof))


def _grad_bytes(prof, stream) -> tuple:
    """:func:`trainable_grad_bytes` from a :func:`gradient_stream`: each class's first block's sum, and the total."""
    per_owner = {}
    for owner, nbytes in stream:
        per_owner[owner] = per_owner.get(owner, 0) + nbytes
    first = {}
    for index, cls in enumerate(prof.block_class):
        first.setdefault(cls, index)
    return tuple(per_owner.get(first[c], 0) for c in range(len(prof.classes))), sum(per_owner.values())


def fastest_kernels(candidates: list, budget_bytes: int, treatments=None, heads=None) -> Profile:
    """The profile of ``candidates`` (one per choice of kernels: :func:`remat.planning.kernels.kernel_choices`)
    whose plan within ``budget_bytes`` is predicted fastest (the first, the kernels measured, on a tie);
    where none fits, the one that comes closest (its plan's ``NoPlanFits`` is then raised)."""
    if len(candidates) == 1:
        return candidates[0]
    from remat.planning.solver import NoPlanFits
    best, closest = None, None
    for candidate in candidates:
        try:
            found = solve_profiled(candidate, budget_bytes, treatments=allowed_treatments(candidate, treatments),
                                   heads=heads)
        except NoPlanFits as error:
            peak = float("inf") if error.smallest_peak is None else error.smallest_peak
            closest = closest if closest is not None and closest[0] <= peak else (peak, candidate)
            continue
        if best is None or found.notes["predicted_step_s"] < best[0]:
            best = (found.notes["predicted_step_s"], candidate)
    return (best or closest)[1]


def _marked(chosen: Plan, prof) -> Plan:
    """``chosen`` with ``notes["compile"]`` (and the compiled calibration) when ``prof`` was compiled,
    ``notes["ran_for_real"]`` when a fake profile ran steps that read values for real (a
    vision-language model's image-token merge: :class:`remat.profiling._fake.ValuedFakeMode`), and
    ``notes["profiled"]`` when a GPU model was profiled with fake tensors (long context); with the
    kernels ``prof``'s blocks were measured with (``kernels``; the blocks Liger's kernels do not
    serve, in ``notes["kernels_stock"]``)."""
    kernels = plan_kernels(prof.block_names, block_kernels(prof))
    if kernels is not None:
        chosen = replace(chosen, kernels=kernels)
    for key in ("ran_for_real", "profiled", "kernels", "kernels_stock"):
        if prof.notes.get(key):
            chosen = replace(chosen, notes=dict(chosen.notes, **{key: prof.notes[key]}))
    if not prof.notes.get("compile"):
        return chosen
    extra = {"compile": True, "compile_scope": profile_scope(prof.notes),
             "compile_backend": prof.notes.get("compile_backend")}
    if isinstance(prof.notes.get("calibration"), dict):
        extra["compile_calibration"] = prof.notes["calibration"]
    return replace(chosen, notes=dict(chosen.notes, **extra))


def auto(model: nn.Module, batch, budget, **kwargs) -> Plan:
    """:func:`plan`, then :func:`remat.apply` the plan to ``model``, in place; returns the plan.

    Args:
        model: the ``nn.Module`` to train.
        batch: a batch with the shapes of training (as :func:`plan`).
        budget: the memory of one device, in bytes or as ``"24GiB"``.
        **kwargs: :func:`plan`'s keyword arguments; ``blocks`` is passed to :func:`remat.apply` too.
            With ``compile=True`` compile the model yourself afterwards (``model.compile()``): the
            plan was made for it.

    Returns:
        The applied :class:`~remat.planning.plans.Plan`.

    Raises:
        Everything :func:`plan` and :func:`remat.apply` raise; :class:`remat.NoPlanFits` when nothing
        fits (the model is then left as it was).

    Example:
        >>> chosen = remat.auto(model, {"input_ids": ids}, "24GiB")     # doctest: +SKIP
        >>> loss = model(input_ids=ids, labels=ids).loss; loss.backward()  # doctest: +SKIP
    """
    from remat.api import apply
    chosen = plan(model, batch, budget, **kwargs)
    apply(model, chosen, blocks=kwargs.get("blocks"))
    return chosen


def allowed_treatments(prof, treatments) -> Optional[list]:
    """The treatments a plan of ``prof`` may use: ``treatments`` as given, else every one profiled
    less the offloading ones where offload cannot run (a CPU, no offload engine, a compiled profile)."""
    available = list(prof.treatments())  # any block's: a hybrid's blocks differ (solver offers each its own)
    if treatments is not None:
        return list(treatments)
    if prof.rates.name == "cpu" or not offload_available() or prof.notes.get("compile"):
        available = [t for t in available if t not in OFFLOADING_TREATMENTS]
    return available


def default_host_limit() -> Optional[int]:
    """Pinned bytes the offload engine's pool may hold by default on this machine (None without it)."""
    try:
        from remat.offload import default_limit
    except ImportError:
        return None
    return default_limit()


def host_share(limit: Optional[int]) -> Optional[int]:
    """One process's share of ``limit`` (the host's pinned bytes) where torchrun started several on
    this host (``LOCAL_WORLD_SIZE``): each rank's engine pins its own blocks' tensors, so a rank
    planned with the whole host would ask for it once per GPU."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return None if limit is None else limit // ranks


def offload_available() -> bool:
    try:
        from remat.offload import engine  # noqa: F401
    except ImportError:
        return False
    return True
