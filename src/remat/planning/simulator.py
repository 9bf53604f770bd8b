"""``remat.simulate``: the peak memory and step time of one training step under a plan.

How: a pure walk over the profile (:mod:`remat.planning.costs`), phase by phase in the order the
step runs: embeddings, each block's forward, the head's forward and backward, each block's
backward in reverse, the embeddings' backward, the optimizer's step. The live bytes of each phase
come from :mod:`remat.planning.memory` (the formula the solver uses too): static memory, what
earlier blocks keep, gradients so far, the phase's own peak and the offload engine's bytes. Block
costs were measured alone with their input as the zero; the simulator rebases each on the live set
at that point, so the sum is exact for a sequential stack whatever mix of treatments is chosen. It
returns a :class:`~remat.planning.simulation.Simulation`.

- time: each phase takes its profiled (effective) seconds, one after another on the GPU; the host
  is taken to run ahead except where the offload engine makes it wait for copies;
- collectives (``profile.comm``, from :mod:`~remat.planning.sharding` or
  :mod:`~remat.planning.replication`): one FIFO link beside the compute, with FSDP2's one-block
  prefetch or DDP's buckets; a phase whose parameters have not arrived waits, and each phase pays
  its copies, launches and contention (:class:`remat.planning.sharding.Link`);
- offload: a model of :class:`remat.offload.engine.OffloadEngine` (FIFO copies at the GPU's copy
  rates, a ``window`` of unreleased bytes, ``prefetch`` in backward). It gives an *expected* peak
  (``peak_bytes``) and a *bound* that holds whatever the timing (``bound_bytes``:
  :func:`remat.planning.offload_model.gpu_overhead_bytes`); without offload they are equal.

Limits: offload is modelled per block, not per saved tensor; a host that waits at every block
drains the GPU's queue, which is not charged; data loading is not in the step; segments plans
(``"segments:K"``) are refused, no block cost describing K blocks recomputed at once; a block
called several times a step is walked once per call (phases named ``name#k``). The phase-by-phase
memory terms and the link's schedule in full: docs/design/planning.md.
"""
from __future__ import annotations

from typing import Optional

from remat.planning.calls import each_call, per_call
from remat.planning.memory import Bytes, LiveBytes, plan_terms
from remat.planning.offload_model import engine_overhead
from remat.planning.plans import OFFLOADING_TREATMENTS, Plan, segment_of
from remat.planning.sharding import Link
from remat.planning.simulation import Phase, Simulation


def block_treatments(profile, plan) -> list:
    """Treatments in block order from a Plan, a ``{name: treatment}`` mapping, a list or one name."""
    names = profile.block_names
    if isinstance(plan, str):
        return [plan] * len(names)
    if isinstance(plan, Plan):
        plan = plan.blocks
    if isinstance(plan, (list, tuple)):
        if len(plan) != len(names):
            raise ValueError(f"a plan as a list needs one treatment per block ({len(names)}), got {len(plan)}")
        return list(plan)
    if hasattr(plan, "get"):
        unknown = [n for n in plan if n not in names]
        if unknown:
            raise ValueError(f"plan names blocks the profile does not have: {unknown[:3]} "
                             f"(profiled blocks: {list(names[:3])} ...)")
        return [plan.get(name, "keep") for name in names]
    raise TypeError(f"plan must be a remat.Plan, a mapping, a list of treatments or a treatment name, "
                    f"got {type(plan).__name__}")


def block_tiles(profile, plan, tile_tokens=None) -> list:
    """Per block, the chunk size of its tiled treatment (None: the default, or a block not tiled), from
    ``tile_tokens``: one size, a sequence (one per block) or a ``{block name: size}`` mapping; None:
    the plan's own (a :class:`Plan`'s ``tile_tokens``), else the default everywhere."""
    names = profile.block_names
    if tile_tokens is None and isinstance(plan, Plan):
        return [plan.tile_of(name) for name in names]
    if tile_tokens is None or isinstance(tile_tokens, int):
        return [tile_tokens] * len(names)
    if hasattr(tile_tokens, "get"):
        return [tile_tokens.get(name) for name in names]
    if len(tile_tokens) != len(names):
        raise ValueError(f"tile_tokens as a sequence needs one size (or None) per block ({len(names)}), "
                         f"got {len(tile_tokens)}")
    return list(tile_tokens)


def host_bytes(profile, treatments, tiles=None) -> int:
    """Pinned host bytes a plan's offloaded tensors take at once (every offloaded block call's, at the
    head: the engine's pool holds them all until their call's backward). ``tiles``: each block's
    chunk size (:func:`block_tiles`; None: the default)."""
    tiles = each_call(profile, tiles or [None] * len(treatments))
    profile, treatments = per_call(profile, treatments)
    return sum(profile.cost(i, t, s).host_bytes for i, (t, s) in enumerate(zip(treatments, tiles))
               if t in OFFLOADING_TREATMENTS)


def offload_sizes(profile, treatments, tiles=None) -> list:
    """Bytes each block call's treatment hands to the offload engine (0 for the others); ``tiles`` as
    for :func:`host_bytes`."""
    tiles = each_call(profile, tiles or [None] * len(treatments))
    profile, treatments = per_call(profile, treatments)
    return [profile.cost(i, t, s).offload_bytes if t in OFFLOADING_TREATMENTS else 0
            for i, (t, s) in enumerate(zip(treatments, tiles))]


def largest_offload(profile, treatment: str) -> int:
    """The most bytes one block call hands to the offload engine under ``treatment``, over the blocks
    that can take it (0 for a treatment that does not offload)."""
    if treatment not in OFFLOADING_TREATMENTS:
        return 0
    flat = per_call(profile, ())[0]
    return max((flat.cost(i, treatment).offload_bytes for i in range(len(flat.block_names))
                if treatment in flat.treatments(i)), default=0)


class _Bus:
    """One copy direction: FIFO copies at a fixed rate; (bytes, start, end) per copy."""

    def __init__(self, rate: float):
        self.rate = rate
        self.free_at = 0.0
        self.copies = []

    def copy(self, nbytes: int, ready: float, not_before: float = 0.0) -> float:
        start = max(self.free_at, ready)
        end = max(start + nbytes / self.rate, not_before)
        self.free_at = end
        self.copies.append((nbytes, start, end))
        return end

    def done_by(self, t: float) -> float:
        """Bytes whose copy has landed by ``t`` (linear within a copy)."""
        total = 0.0
        for nbytes, start, end in self.copies:
            if t >= end:
                total += nbytes
            elif t > start:
                total += nbytes * (t - start) / (end - start)
        return total

    def when_done(self, nbytes: float) -> float:
        """The time at which ``nbytes`` (counted from the first copy) have landed."""
        total = 0.0
        for size, start, end in self.copies:
            if total + size >= nbytes:
                return start + (end - start) * (nbytes - total) / size if size else end
            total += size
        return self.free_at


def simulate(profile, plan, *, head: Optional[str] = None, chunk_tokens: Optional[int] = None,
             tile_tokens=None) -> Simulation:
    """Predicted peak bytes, step seconds and what sets the peak, for ``plan`` on ``profile``.

    Args:
        profile: a :class:`~remat.planning.costs.Profile` (:func:`remat.profile`).
        plan: a :class:`~remat.planning.plans.Plan`, a ``{block name: treatment}`` mapping, a list
            of one treatment per block, or one treatment name for every block.
        head: the head mode; default the plan's own (a Plan) or ``"plain"``.
        chunk_tokens: the chunked head's chunk; default the plan's own.
        tile_tokens: the tiled blocks' chunks (one size, one per block or a mapping:
            :func:`block_tiles`); default the plan's own. A tiled block is priced at the profiled
            chunk that stands for its own (:meth:`~remat.planning.costs.Profile.tile_size`).

    Returns:
        A :class:`~remat.planning.simulation.Simulation`: expected peak and bound, step seconds,
        the phase that sets the peak, and every phase.

    Raises:
        ValueError: a segments plan (``"segment:<i>"`` blocks: no cost describes them), a list of
            the wrong length, block names the profile lacks, a treatment it did not profile.

    Example:
        >>> sim = remat.simulate(remat.profile(model, batch), "full")   # doctest: +SKIP
        >>> sim.peak_bytes, sim.step_s                                  # doctest: +SKIP
    """
    treatments = block_treatments(profile, plan)
    segmented = [t for t in treatments if segment_of(t) is not None]
    if segmented:
        raise ValueError(f"a segments plan ({len(segmented)} blocks in segments, e.g. {segmented[0]!r}) is applied "
                         "as given and not simulated: the profile has no cost for K blocks recomputed at once; "
                         "simulate a plan of per-block treatments (full, selective, ...) instead")
    if isinstance(plan, Plan):
        head = head or plan.head
        chunk_tokens = chunk_tokens or plan.chunk_tokens
    h = profile.head(head or "plain", chunk_tokens)
    tiles = [profile.tile_size(i, t, s) for i, (t, s) in enumerate(zip(treatments, block_tiles(profile, plan,
                                                                                              tile_tokens)))]
    tiles = each_call(profile, tiles)
    profile, treatments = per_call(profile, treatments)   # a block called N times is walked N times
    costs = [profile.cost(i, t, s) for i, (t, s) in enumerate(zip(treatments, tiles))]
    return _walk(profile, treatments, costs, h, tiles)


def _walk(profile, treatments, costs, h, tiles) -> Simulation:
    walk = _Walk(profile, treatments, costs, h, tiles)
    walk.root_gather()
    walk.embeddings_forward()
    for i in range(len(costs)):
        walk.block_forward(i)
    walk.head()
    walk.backward_start()
    for i in reversed(range(len(costs))):
        walk.block_backward(i)
    walk.embeddings_backward()
    walk.optimizer_step()
    return walk.result()


class _Walk:
    """One step walked phase by phase (:func:`_walk` calls one method per phase, in the step's
    order): the clocks of the host and the GPU, the copy buses, the collectives' link, and the
    timeline of :class:`~remat.planning.simulation.Phase` records."""

    def __init__(self, profile, treatments, costs, h, tiles):
        self.profile, self.treatments, self.costs, self.h = profile, treatments, costs, h
        self.names = profile.block_names
        # a tiled block's phases name its chunk
        self.labels = [t if s is None else f"{t} in chunks of {s}" for t, s in zip(treatments, tiles)]
        self.engine = profile.engine
        self.off = [c.offload_bytes if t in OFFLOADING_TREATMENTS else 0 for t, c in zip(treatments, costs)]
        self.window = self.engine.window(self.off)
        self.overhead = engine_overhead(self.engine, self.off)
        self.terms = plan_terms(profile, costs, self.off)
        self.live = LiveBytes(profile.static_bytes, h, profile.optimizer_temp_bytes)
        self.static = profile.static_bytes
        self.timeline = []
        self.clock = {"host": 0.0, "gpu": 0.0}  # the host moves only when it waits for the engine's window
        self.comm = profile.comm
        self.link = Link(self.comm, self.clock) if self.comm else None
        self.ddp = bool(self.comm) and self.comm.kind == "ddp"
        self.gathered = [0.0] * len(costs)      # forward: when block i's parameters are all-gathered
        self.regathered = [0.0] * len(costs)    # backward: the same, when resharded after forward
        self.waits = []                         # seconds the GPU waited for collectives
        self.d2h = _Bus(profile.rates.d2h_Bps)
        self.packed, self.released = 0, 0.0     # offloaded bytes so far; released by the engine
        self.exposed = 0.0
        self.held = 0.0

    def run(self, seconds, ready=0.0, gathered=0.0):
        """Run one phase once the GPU, the host, its data (``ready``: offloaded bytes back) and its
        parameters (``gathered``: all-gathered) are; (start, waited for data, waited for parameters)."""
        clock = self.clock
        free = max(clock["gpu"], clock["host"])
        start = max(free, ready, gathered)
        waited = max(0.0, ready - free)
        clock["gpu"] = start + seconds
        return start, waited, max(0.0, gathered - max(free, ready))

    def phase(self, name, b, start, bound=0, held=0.0, end=None, wait=0.0, comm_wait=0.0, over=0.0):
        """``b``: the phase's :class:`~remat.planning.memory.Bytes` without the engine's; ``held``:
        the engine's expected bytes (at its peak and, unless ``end`` is given, at its end);
        ``bound``: the engine's bound at its peak."""
        end = b.end + held if end is None else end
        self.timeline.append(Phase(name=name, peak_bytes=int(b.peak + held), end_bytes=int(end),
                                   start_s=start, end_s=self.clock["gpu"], bound_bytes=int(b.peak + bound),
                                   engine_bytes=int(held), wait_s=wait, carried_bytes=int(b.carried - self.static),
                                   comm_s=comm_wait, overhead_s=over))
        self.waits.append(comm_wait)

    # ---- forward
    def root_gather(self):
        """FSDP2's root all-gather: nothing to hide it behind; then its copies."""
        comm, static = self.comm, self.static
        if comm and comm.root_gather_bytes:
            root = self.link.issue(comm.root_gather_bytes, ready=0.0)
            over = self.link.charge(comm.root_fwd_copy_bytes, comm.root_fwd_launches)
            start, _, cw = self.run(over, gathered=root)
            self.phase("forward: all-gather of the root", Bytes(static, static, static), start, comm_wait=cw,
                       over=over)

    def embeddings_forward(self):
        comm, h = self.comm, self.h
        start, _, cw = self.run(h.pre_fwd_s)
        over = 0.0
        if comm:
            if self.costs and comm.gather_bytes[0]:
                self.gathered[0] = self.link.issue(comm.gather_bytes[0], ready=start)
            over = self.link.stretch(start, h.pre_fwd_s)
        self.phase("forward: embeddings", self.live.embeddings_forward(), start, comm_wait=cw, over=over)

    def block_forward(self, i):
        comm, link, clock, off, d2h = self.comm, self.link, self.clock, self.off, self.d2h
        c = self.costs[i]
        held = self.packed - self.released
        over = link.block(i, backward=False) if comm else 0.0
        start, _, cw = self.run(c.fwd_s + over, gathered=self.gathered[i])
        if comm:
            if i + 1 < len(self.costs) and comm.gather_bytes[i + 1]:  # prefetched while this block computes
                self.gathered[i + 1] = link.issue(comm.gather_bytes[i + 1], ready=start)
            over += link.stretch(start, c.fwd_s + over)
        wait = 0.0
        if off[i]:
            # ``offload`` saves over its whole forward, ``full+offload`` its input at the start
            d2h.copy(off[i], ready=start, not_before=clock["gpu"] if self.treatments[i] == "offload" else start)
            self.packed += off[i]
            if self.packed - d2h.done_by(clock["host"]) > self.window:   # the host waits for the oldest copies
                t = d2h.when_done(self.packed - self.window)
                wait = max(0.0, t - clock["gpu"])               # the GPU idles only once its queue ran dry
                clock["host"] = t
                clock["gpu"] = max(clock["gpu"], t)
            self.released = d2h.done_by(clock["host"])              # released at the block's end
        self.exposed += wait
        b = self.live.forward(self.terms[i])
        self.phase(f"forward of block {i} ({self.names[i]}, {self.labels[i]})", b, start,
                   bound=self.overhead["forward"][i], held=held, end=b.end + self.packed - self.released, wait=wait,
                   comm_wait=cw, over=over)

    # ---- head: nothing is released until the backward starts
    def head(self):
        comm, link, h = self.comm, self.link, self.h
        held = self.held = self.packed - self.released
        start, _, _ = self.run(h.head_fwd_s)
        over = link.stretch(start, h.head_fwd_s) if comm else 0.0
        self.phase("forward: head and loss", self.live.head_forward(), start, bound=self.overhead["head"], held=held,
                   over=over)
        start, _, _ = self.run(h.head_bwd_s)
        over = 0.0
        if comm:
            if comm.reshard_after_forward and self.costs and comm.gather_bytes[-1]:
                self.regathered[-1] = link.issue(comm.gather_bytes[-1], ready=start)
            over = link.stretch(start, h.head_bwd_s)
        self.phase("backward: head and loss", self.live.head_backward(), start, bound=self.overhead["head"],
                   held=held, over=over)

    # ---- backward
    def backward_start(self):
        """Bytes still queued at the end of the forward, newest first, beyond the ``issue_bytes``
        being copied, were never issued: they stay on the GPU until their block's backward (never
        moved). The first unpack releases the copies that landed (all, by then)."""
        off = self.off
        self.never = [0.0] * len(self.costs)
        unissued = max(0.0, self.held - self.engine.issue_bytes)
        for j in reversed(range(len(self.costs))):
            self.never[j] = min(off[j], unissued)
            unissued -= self.never[j]
        self.h2d = _Bus(self.profile.rates.h2d_Bps)
        self.arrives = {}       # offloaded block -> time its bytes are back on the GPU
        self.fetched = set()    # blocks fetched (their bytes on the GPU) and not yet done
        self.unpacked = False
        self.records = [j for j in range(len(self.costs)) if off[j]]
        self.moved = sum(o - n for o, n in zip(off, self.never))

    def block_backward(self, i):
        comm, link, clock, off, never, fetched = self.comm, self.link, self.clock, self.off, self.never, self.fetched
        c = self.costs[i]
        if off[i]:  # its first unpack makes it current: fetch it and the records before it
            self.unpacked = True
            earlier = [j for j in self.records if j < i][::-1][:self.engine.prefetch_blocks]
            begin = max(clock["gpu"], clock["host"])
            for j in [i] + earlier:
                if j not in fetched:
                    fetched.add(j)
                    self.arrives[j] = self.h2d.copy(off[j] - never[j], ready=begin) if off[j] > never[j] else begin
        over = link.block(i, backward=True) if comm else 0.0
        start, wait, cw = self.run(c.bwd_s + over, ready=self.arrives.get(i, 0.0), gathered=self.regathered[i])
        if comm:
            if comm.reshard_after_forward and i > 0 and comm.gather_bytes[i - 1]:  # prefetched beside it
                self.regathered[i - 1] = link.issue(comm.gather_bytes[i - 1], ready=start)
            for fraction, nbytes in (comm.buckets[i] if self.ddp else ()):  # DDP: each bucket once it fills
                link.issue(nbytes, ready=start + fraction * (c.bwd_s + over), reduce=True)
            over += link.stretch(start, c.bwd_s + over)
            if not self.ddp:  # FSDP2: its gradients, once its backward ends
                link.issue(comm.reduce_bytes[i], ready=clock["gpu"], reduce=True)
        self.exposed += wait
        if self.unpacked:  # earlier blocks' bytes on the GPU: fetched ahead, or never moved
            self.held = sum(off[j] if j in fetched else never[j] for j in range(i))
        treatment = self.treatments[i]
        what = "recompute + backward" if treatment not in ("keep", "offload") else "backward"
        self.phase(f"backward of block {i} ({self.names[i]}, {self.labels[i]}: {what})",
                   self.live.backward(i, self.terms[i]), start, bound=self.overhead["backward"][i], held=self.held,
                   wait=wait, comm_wait=cw, over=over)
        fetched.discard(i)

    def embeddings_backward(self):
        comm, link, h = self.comm, self.link, self.h
        if not comm:
            start, _, _ = self.run(h.pre_bwd_s)
            self.phase("backward: embeddings", self.live.embeddings(), start)
            return
        # the root's copies after the embeddings' backward, its reduction last; the step ends with the link
        over = link.charge(comm.root_bwd_copy_bytes, comm.root_bwd_launches)
        start, _, _ = self.run(h.pre_bwd_s + over)
        over += link.stretch(start, h.pre_bwd_s + over)
        self.phase("backward: embeddings", self.live.embeddings(), start, over=over)
        if comm.root_reduce_bytes:
            link.issue(comm.root_reduce_bytes, ready=self.clock["gpu"], reduce=True)
        end = self.timeline[-1].end_bytes
        if link.free_at > self.clock["gpu"]:
            start, _, cw = self.run(0.0, gathered=link.free_at)
            self.phase(f"backward: {'all-reduces' if self.ddp else 'reduce-scatters'} left at the end",
                       Bytes(end, end, end), start, comm_wait=cw)
        if comm.final_copy_bytes and comm.copy_Bps:  # DDP: the reduced buckets back into the gradients
            over = link.charge(comm.final_copy_bytes, 0)
            start, _, _ = self.run(over)
            self.phase("backward: gradients copied out of the buckets", Bytes(end, end, end), start, over=over)

    def optimizer_step(self):
        """The optimizer's step, once the backward and its collectives are done (none: no phase)."""
        profile = self.profile
        if profile.optimizer == "none" and not profile.optimizer_s:
            return
        start, _, _ = self.run(profile.optimizer_s)
        self.phase(f"optimizer step ({profile.optimizer})", self.live.optimizer_step(), start)

    def result(self) -> Simulation:
        comm, link, h, profile = self.comm, self.link, self.h, self.profile
        top = max(self.timeline, key=lambda p: p.peak_bytes)
        worst = max(self.timeline, key=lambda p: p.bound_bytes)
        step = self.clock["gpu"] + profile.step_overhead_s  # the optimizer's phase ran once the link was idle
        return Simulation(peak_bytes=top.peak_bytes, step_s=step, tokens_per_s=profile.tokens / step if step else 0.0,
                          peak_at=top.name, static_bytes=self.static, head=h.mode, chunk_tokens=h.chunk_tokens,
                          timeline=tuple(self.timeline), offload_bytes=sum(self.off), exposed_copy_s=self.exposed,
                          bound_bytes=worst.bound_bytes, bound_at=worst.name, moved_bytes=int(self.moved),
                          comm_s=comm.total_s() if comm else 0.0, exposed_comm_s=sum(self.waits),
                          comm_copy_s=link.copy_s if comm else 0.0, comm_launch_s=link.launch_s if comm else 0.0,
                          comm_contention_s=link.contention_s if comm else 0.0, optimizer_s=profile.optimizer_s)
