"""What one rank's training step communicates under FSDP2 or DDP, and how the time model charges it.

How: :class:`Collectives` is a plain frozen dataclass, built by keyword only, held by a
:class:`~remat.planning.costs.Profile` as ``comm``. The builders fill it from the model's
parameter sizes and a bus rate (:func:`remat.planning.sharding.shard` for FSDP2,
:func:`remat.planning.replication.replicate` for DDP); :mod:`remat.planning.simulator` places
its transfers on one link beside the compute, and its ``block_exposed_s`` / ``fixed_exposed_s``
give the solver the same charge per block, additively.

Why apart from the other costs: a profile's block and head costs are measured on one GPU and
hold for any world size; these numbers are the plan's world and wrapper, computed, never
measured by the profiler. Like :mod:`remat.planning.costs`, this module imports neither torch
nor the measuring code.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Collectives:
    """The collectives of one rank's training step (FSDP2 or DDP), as the time model charges them.

    Built by :func:`remat.planning.sharding.shard` (``kind="fsdp2"``) or
    :func:`remat.planning.replication.replicate` (``kind="ddp"``); :func:`remat.simulate` places
    them on one link beside the compute (see :mod:`remat.planning.simulator`). Sizes are the whole
    unsharded group's bytes; a ring all-gather or reduce-scatter moves ``(world - 1) / world`` of
    them over each GPU's link, an all-reduce twice that.

    Beside the link, three overheads land on the compute stream (fields below, all zero unless
    the builder sets them): copies into and out of the communication buffers at ``copy_Bps``, a
    fixed ``latency_s`` per collective, and compute slowed by ``contention`` while the link is busy.
    """

    world: int
    """Ranks in the group."""
    bus_Bps: float
    """Bus bandwidth of the link (nccl-tests' busbw), bytes/s."""
    gather_bytes: tuple
    """Per block: its parameters' bytes in the param dtype (one all-gather assembles them; 0 under DDP)."""
    reduce_bytes: tuple
    """Per block: FSDP2, its gradients' bytes in the reduce dtype (one reduce-scatter when its
    backward ends); DDP, the bytes of the buckets that fill during its backward (see ``buckets``)."""
    root_gather_bytes: int
    """The root's own parameters (embeddings, final norm, LM head): all-gathered once, before
    anything runs (FSDP2 never reshards the root after forward)."""
    root_reduce_bytes: int
    """Reduced after everything else: FSDP2, the root's gradients; DDP, the buckets that fill last."""
    reshard_after_forward: bool = True
    """Blocks are resharded after forward and all-gathered again for backward (FSDP2's default)."""
    bus_measured: bool = False
    """``bus_Bps`` was timed on the process group, not read from :data:`GPUS`."""
    kind: str = "fsdp2"
    """``"fsdp2"`` (all-gathers and reduce-scatters) or ``"ddp"`` (bucketed all-reduces)."""
    buckets: tuple = ()
    """DDP: per block, ``((fraction, bytes), ...)``: the all-reduces launched while its backward
    runs, each once that fraction of the backward has produced its bucket's last gradient."""
    copy_Bps: float = 0.0
    """Rate of the copies on the compute stream, bytes/s (read + write counted); 0: not charged."""
    contention: float = 0.0
    """Fraction by which compute slows while the link is busy beside it (NCCL's SMs and HBM traffic)."""
    latency_s: float = 0.0
    """Fixed seconds on the compute stream per collective (launch, and FSDP2's Python hooks)."""
    fwd_copy_bytes: tuple = ()
    """Per block: bytes copied on the compute stream in its forward (FSDP2: the all-gather's
    copy-in and copy-out)."""
    bwd_copy_bytes: tuple = ()
    """Per block: the same in its backward (FSDP2: the backward all-gather's copies and the
    reduce-scatter's copy-in; DDP: its gradients into the buckets)."""
    fwd_launches: tuple = ()
    """Per block: collectives launched in its forward (each costs ``latency_s``)."""
    bwd_launches: tuple = ()
    """Per block: collectives launched in its backward."""
    root_fwd_copy_bytes: int = 0
    """Copied with the root's all-gather, before anything runs."""
    root_bwd_copy_bytes: int = 0
    """Copied after the embeddings' backward, before the last reduction is launched."""
    root_fwd_launches: int = 0
    """Collectives launched before the first block (the root's all-gather)."""
    root_bwd_launches: int = 0
    """Collectives launched after the embeddings' backward."""
    final_copy_bytes: int = 0
    """Copied once every collective has ended (DDP: the reduced buckets back into the gradients)."""

    def seconds(self, nbytes: float) -> float:
        """Seconds of one all-gather or reduce-scatter of ``nbytes`` (the unsharded size)."""
        return nbytes * (self.world - 1) / self.world / self.bus_Bps if nbytes else 0.0

    def reduce_s(self, nbytes: float) -> float:
        """Seconds of one reduction of ``nbytes``: a reduce-scatter, or (DDP) an all-reduce, twice that."""
        return self.seconds(nbytes) * (2 if self.kind == "ddp" else 1)

    def copy_s(self, nbytes: float) -> float:
        """Seconds of copying ``nbytes`` (read + write) on the compute stream; 0 when not charged."""
        return nbytes / self.copy_Bps if nbytes and self.copy_Bps else 0.0

    def overhead_s(self, index: int) -> tuple:
        """(forward, backward) seconds block ``index`` adds to the compute stream: copies and launches."""
        def at(values):
            return values[index] if values else 0
        return (self.copy_s(at(self.fwd_copy_bytes)) + self.latency_s * at(self.fwd_launches),
                self.copy_s(at(self.bwd_copy_bytes)) + self.latency_s * at(self.bwd_launches))

    def root_overhead_s(self) -> tuple:
        """(before the first block, after the embeddings' backward, after every collective) seconds
        on the compute stream outside the blocks."""
        return (self.copy_s(self.root_fwd_copy_bytes) + self.latency_s * self.root_fwd_launches,
                self.copy_s(self.root_bwd_copy_bytes) + self.latency_s * self.root_bwd_launches,
                self.copy_s(self.final_copy_bytes))

    def window_s(self, link_s: float, compute_s: float, delay_s: float = 0.0) -> float:
        """Seconds beyond ``compute_s`` for a phase whose link work (``link_s``, on a link idle when
        the phase starts) runs beside it: compute slowed by ``contention`` while they overlap (from
        ``delay_s`` into the phase, when the work starts later), and then whatever of the link work
        is left. The delay shortens the overlap only: what ends after the phase is taken to have
        started early enough to be done by then (DDP's last bucket hides in the next backward)."""
        slowed = compute_s + self.contention * min(link_s, max(0.0, compute_s - delay_s))
        return max(link_s, slowed) - compute_s

    def total_s(self) -> float:
        """Seconds the link is busy in one step."""
        gathers = sum(self.gather_bytes) * (2 if self.reshard_after_forward else 1) + self.root_gather_bytes
        return self.seconds(gathers) + self.reduce_s(sum(self.reduce_bytes) + self.root_reduce_bytes)

    def block_exposed_s(self, index: int, fwd_s: float, bwd_s: float) -> float:
        """Seconds block ``index`` adds beyond its own forward and backward compute: its overheads on
        the compute stream (:meth:`overhead_s`) and, per :meth:`window_s`, the communication its
        compute slows for or fails to hide. FSDP2: the next block's all-gather runs during its
        forward, and during its backward the reduce-scatter of the block after it and (resharded)
        the all-gather of the block before it. DDP: its backward carries the all-reduces of the
        buckets that fill in it. Additive over blocks; :meth:`fixed_exposed_s` adds what no
        block's treatment changes. The sum is the simulator's when FSDP2 blocks are resharded after
        forward, and an upper bound when not (nothing waits in backward then, so a reduce-scatter's
        excess may hide later); for DDP an estimate (its all-reduces overlap it from when its first
        bucket fills, the later ones taken to follow at once; nothing waits for them before the end
        of the step): within about 1% of the simulator with several buckets a block."""
        n = len(self.gather_bytes)
        over_f, over_b = self.overhead_s(index)
        ahead = self.gather_bytes[index + 1] if index + 1 < n else 0
        behind = self.gather_bytes[index - 1] if index > 0 and self.reshard_after_forward else 0
        delay = 0.0
        if self.kind == "ddp":  # its buckets' all-reduces, from when the first one fills
            reduced = self.reduce_s(self.reduce_bytes[index])
            delay = self.buckets[index][0][0] * (bwd_s + over_b) if self.buckets and self.buckets[index] else 0.0
        else:
            reduced = self.reduce_s(self.reduce_bytes[index + 1]) if index + 1 < n else 0.0
        return (over_f + self.window_s(self.seconds(ahead), fwd_s + over_f)
                + over_b + self.window_s(reduced + self.seconds(behind), bwd_s + over_b, delay))

    def fixed_exposed_s(self, head) -> float:
        """The seconds outside the blocks' windows (``head``: a :class:`HeadCost`): the root's
        all-gather and its copies, the first block's all-gather beside the embeddings' forward, the
        last block's backward all-gather beside the head's backward, the first block's reduce-scatter
        beside the embeddings' backward and the root's copies, the last reduction (the root's
        reduce-scatter, DDP's last buckets) and the copies after it."""
        last = self.gather_bytes[-1] if self.gather_bytes and self.reshard_after_forward else 0
        first_gather = self.gather_bytes[0] if self.gather_bytes else 0
        first_reduce = self.reduce_bytes[0] if self.reduce_bytes and self.kind != "ddp" else 0
        before, after, final = self.root_overhead_s()
        return (self.seconds(self.root_gather_bytes) + before
                + self.window_s(self.seconds(first_gather), head.pre_fwd_s)
                + self.window_s(self.seconds(last), head.head_bwd_s)
                + after + self.window_s(self.reduce_s(first_reduce), head.pre_bwd_s + after)
                + self.reduce_s(self.root_reduce_bytes) + final)
