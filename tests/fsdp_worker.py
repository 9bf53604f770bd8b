"""Run by test_fsdp.py in its own process: remat.apply, then FSDP2 fully_shard (world size 1,
gloo, CPU); gradients must equal an untouched, unsharded copy. Prints OK or the differences."""
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from families import FAMILIES  # noqa: E402

import remat  # noqa: E402

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6 spelled it here
    from torch.distributed._composable.fsdp import fully_shard


def main(spec):
    dist.init_process_group("gloo", rank=0, world_size=1)
    model, make_inputs = FAMILIES["llama"]()
    reference = copy.deepcopy(model)
    inputs = make_inputs()  # before sharding: make_inputs uses the embedding weights
    remat.apply(model, spec)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,))  # stay on the CPU even where a GPU is visible
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    problems = []
    for m in (model, reference):
        torch.manual_seed(3)
        m(**inputs).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if q.grad is None:
            if grad is not None and grad.any():
                problems.append(f"{name}: gradient where the reference has none")
        elif not torch.equal(grad, q.grad):
            problems.append(f"{name}: gradient differs")
    if "_checkpoint_wrapped_module" in "".join(model.state_dict()):
        problems.append("state_dict keys changed")
    dist.destroy_process_group()
    print("OK" if not problems else "\n".join(problems))


if __name__ == "__main__":
    main(sys.argv[1])
