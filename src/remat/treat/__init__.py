"""What remat does to a model: find its blocks, treat them, chunk its head.

Every change to a user's module goes through :mod:`remat.treat.patches` (one install, one
undo). :mod:`~remat.treat.discovery` finds blocks and heads; :mod:`~remat.treat.treatments`
runs a block under checkpointing, selective checkpointing or offload; :mod:`~remat.treat.head`
puts the chunked loss in place of a Hugging Face model's LM head and loss.
"""
