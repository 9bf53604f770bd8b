"""Optimizer state in place before a benchmark's first step, so that every measured step holds it.

PyTorch's Adam/AdamW create their state (``exp_avg``, ``exp_avg_sq``: two copies of every trained
parameter) inside the first ``optimizer.step()``, after that step's forward and backward. A
benchmark that can afford one step only (a long-context step takes minutes) would then measure a
peak without that state, under what every later step holds (4.6 GiB for llama-1b's AdamW in bf16,
15 GiB a rank for the 8B model over 2 FSDP2 ranks): not the step a plan predicts.

:func:`allocate_state` runs one step with zero gradients at learning rate 0, then sets each state's
step count back to 0. With zero gradients the moments stay zero and no parameter moves (the
decoupled weight decay is scaled by the learning rate), so the optimizer is then the same as a fresh
one, its state allocated.
"""
import torch


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    held = [(p, p.grad) for p in params]
    rates = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    for p, grad in held:
        p.grad = grad
        state = optimizer.state.get(p, {})
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
