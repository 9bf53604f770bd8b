"""What remat does to a model's blocks: find them, treat them, undo it.

Every change to a user's module goes through :mod:`remat.treat.patches` (one install, one
undo). :mod:`~remat.treat.discovery` finds blocks and heads; :mod:`~remat.treat.treatments`
runs a block under checkpointing, selective checkpointing or offload, as the block's
:class:`remat.planning.records.BlockRecord` says (the plan resolved once, in :mod:`remat.planning`;
nothing here reads a treatment's name), handing each treated block what the untouched block would
see (:mod:`~remat.treat.block_state`: its KV cache as a view, state the model writes in place after
it); :mod:`~remat.treat.refusals` holds the error of a refusal from inside a step;
:mod:`~remat.treat.kernels` runs a block's norms, gated MLP and rotary embedding (and the LM loss)
with liger-kernel's fused kernels, per instance, as a record's ``kernel`` says; the chunked LM head,
which patches through the same registry, is its own package, :mod:`remat.head`.
"""
