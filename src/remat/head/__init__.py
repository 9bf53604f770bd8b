"""The LM head and its loss, computed a chunk of tokens at a time: the [tokens x vocab] logits never exist.

Three layers, as Liger-Kernel splits its fused loss (ops / model glue / patching):

- the loss op and its kernels, plain torch and Triton, knowing nothing of Hugging Face:
  :mod:`~remat.head.chunked_loss` (:func:`chunked_cross_entropy`, the autograd function that
  finishes every gradient in its forward), :mod:`~remat.head.xent_kernel` (one chunk's loss and
  logits gradient: fused and compiled on CUDA, eager elsewhere), :mod:`~remat.head.xent_triton`
  (that chunk as one Triton program a row), :mod:`~remat.head.grad_scale` (backward's scaling of
  the finished gradients, in fp32);
- the Hugging Face model glue, :mod:`~remat.head.hf_model`: what a model's forward does with its
  labels and logits (shifting, ignore_index, num_items_in_batch, soft-caps and scales, logits
  biases, encoder-decoder inputs, router losses), read from the model and checked on a probe,
  and that loss computed again by the op; :mod:`~remat.head.transform` reads the logit transform
  from the forward's own statements and runs them on each chunk;
- the patching, :mod:`~remat.head.patching`: :func:`enable_chunked_head` intercepts the model's
  ``lm_head`` call and puts the glue's loss in place of the model's; :func:`disable_chunked_head`
  takes it off. Beside it, :mod:`~remat.head.trl` finds TRL's fused LM head, which replaces the
  model's and never calls a chunked head put under it.

Imports: the loss op and kernels import torch (Triton only when a CUDA kernel is made) and of remat
only :mod:`remat.caches`, where their kernels are registered; the glue imports the op (transformers
only inside a call, to name the model's loss function); the patching imports the glue, the TRL
check the patching, and both :mod:`remat.treat.patches`, the one registry of changes to a user's
module (the patching also :mod:`remat.treat.dynamo_cache`, for the frames dynamo skips, and
:mod:`remat.treat.refusals`, the error of a refusal from inside a step). This
package must never import :mod:`remat.profiling`, :mod:`remat.planning`, :mod:`remat.planner`,
:mod:`remat.api`, :mod:`remat.offload`, :mod:`remat.diagnosis`, :mod:`remat.integrations` or
:mod:`remat.cli`: they call the head; the head calls none of them.
"""
from remat.head.chunked_loss import chunked_cross_entropy, default_chunk_tokens
from remat.head.hf_model import check_chunked_head
from remat.head.patching import disable_chunked_head, enable_chunked_head, has_chunked_head
from remat.head.trl import find_trl_head, remat_head_bypassed

__all__ = ["check_chunked_head", "chunked_cross_entropy", "default_chunk_tokens", "disable_chunked_head",
           "enable_chunked_head", "find_trl_head", "has_chunked_head", "remat_head_bypassed"]
