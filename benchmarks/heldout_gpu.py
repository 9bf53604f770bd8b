"""Held-out models, as a user would bring them, planned at half of eager's peak (issues 10, 29).

A Qwen3-like dense LM, a Gemma-2-like LM trained at a sequence longer than its sliding window
(window and global layers profiled apart), a Mixtral-like MoE with router logits on (the aux
loss is in ``.loss``; ``mixtral`` small and host-bound, ``mixtral_large`` with Mixtral-8x7B's
block and GPU-bound), a ViT classifier trained through a user ``loss_fn``, a Qwen3-Next-shaped
hybrid (linear-attention and attention layers, MoE) and the Qwen2-VL-2B-shaped preset on image +
text batches. Each is built from its transformers config class with that class's defaults
(``use_cache`` left on), in bf16 on the GPU, and measured in one process with one protocol:
``zero_grad(set_to_none=True)``, loss, backward; ``--warmup`` steps, then the peak
(``max_memory_allocated`` after a reset) and median time of ``--steps`` steps.

Per model, in order: ``eager`` (no checkpointing), ``hf_full`` (HF gradient checkpointing,
non-reentrant), ``remat@half`` (``remat.plan`` at half of eager's measured peak) and, when
half of eager is above HF's peak, ``remat@hf`` (planned at HF's measured peak, so speed is
compared at no more memory). The remat rows check:

- measured peak <= budget;
- loss equal to eager's: bit for bit under ``torch.use_deterministic_algorithms(True)`` when
  the plan keeps the model's own head; a chunked head is compared with eager's loss by its
  relative difference, and the plan's blocks are then run once more with the model's own
  head, which must give eager's loss bit for bit;
- every parameter gradient against eager's: max relative difference, beside eager-vs-eager
  (a second eager step) so backward kernels that are not deterministic show as such;
- tokens (ViT: patches + CLS) per second against ``hf_full``'s.

Run: ``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python benchmarks/heldout_gpu.py --out DIR``
(``--only qwen3,vit`` for a subset). Writes ``DIR/heldout.jsonl`` and prints one line per row.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import remat
from remat.prove.bench import environment

GiB = 2 ** 30


def _causal_lm(config):
    from remat.presets import attention_for, build_model
    return build_model(config, device="cuda", dtype=torch.bfloat16, attn_implementation=attention_for(config))


def qwen3():
    from transformers import Qwen3Config
    config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    return _causal_lm(config), _lm_batch(config.vocab_size, 4, 2048), None


def gemma2():
    from transformers import Gemma2Config
    config = Gemma2Config(vocab_size=256000, hidden_size=1536, intermediate_size=6144, num_hidden_layers=12,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=192, sliding_window=1024)
    return _causal_lm(config), _lm_batch(config.vocab_size, 2, 4096), None   # 4096 > the 1024 window


def mixtral():
    from transformers import MixtralConfig
    config = MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=12,
                           num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                           num_experts_per_tok=2, output_router_logits=True)
    return _causal_lm(config), _lm_batch(config.vocab_size, 4, 2048), None


def mixtral_large():
    """Mixtral-8x7B's block (hidden 4096, 8 experts of 14336 top-2, 32/8 heads of 128) in 4 layers,
    6.1B parameters, so that weights and gradients (22.6 GiB) leave room for the activations of
    2 x 4096 tokens on one GPU; router logits on, as in ``mixtral``. ``mixtral``'s step waits on its
    host (``benchmarks/results/issue29``), this one on its GPU (about 90 TFLOP of matmuls a step):
    ``--only mixtral_large --uniform selective,mlp`` compares the two treatments by what they recompute."""
    from transformers import MixtralConfig
    config = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                           num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                           num_experts_per_tok=2, output_router_logits=True)
    return _causal_lm(config), _lm_batch(config.vocab_size, 2, 4096), None


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    config = ViTConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=224, patch_size=16, num_labels=1000)
    torch.manual_seed(0)
    model = ViTForImageClassification(config).to("cuda", torch.bfloat16).train()
    generator = torch.Generator(device="cuda").manual_seed(1)
    batch = {"pixel_values": torch.randn(128, 3, 224, 224, device="cuda", dtype=torch.bfloat16,
                                         generator=generator),
             "labels": torch.randint(0, 1000, (128,), device="cuda", generator=generator)}

    def loss_fn(model, batch):  # the user's own loss: the model is called without labels
        logits = model(pixel_values=batch["pixel_values"]).logits
        return F.cross_entropy(logits.float(), batch["labels"])
    return model, batch, loss_fn


def qwen3_next():
    """Qwen3-Next's layer shapes (gated delta-net linear attention in three of four layers, gated
    full attention in the fourth, a routed MoE with a shared expert in every layer), 8 layers and
    64 experts instead of 48 and 512 so that a full fine-tune fits one GPU; use_cache on."""
    from transformers import Qwen3NextConfig
    config = Qwen3NextConfig(num_hidden_layers=8, num_experts=64, layer_types=["linear_attention"] * 3
                             + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])
    return _causal_lm(config), _lm_batch(config.vocab_size, 2, 4096), None


def qwen2_vl():
    """The qwen2-vl-2b preset (Qwen2-VL-2B's shapes, random weights): image + text batches, two
    448 x 448 images per sequence of 4096 tokens, labels on every text token."""
    from remat.presets import build_model, image_text_batch, load_config
    config = load_config("qwen2-vl-2b")
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    batch = image_text_batch(config, batch=2, seq=4096, images=2, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    text = batch["labels"] != -100   # random text and pixels, not the builder's constants: never time zeros
    words = torch.randint(0, config.text_config.vocab_size // 2, batch["input_ids"].shape, generator=generator)
    batch["input_ids"] = torch.where(text, words, batch["input_ids"])
    batch["labels"] = batch["input_ids"].masked_fill(~text, -100)
    batch["pixel_values"] = torch.randn(batch["pixel_values"].shape, generator=generator).to(torch.bfloat16)
    return model, {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, None


MODELS = {"qwen3": qwen3, "gemma2": gemma2, "mixtral": mixtral, "mixtral_large": mixtral_large, "vit": vit,
          "qwen3_next": qwen3_next, "qwen2_vl": qwen2_vl}


def _lm_batch(vocab, batch, seq):
    generator = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=generator)
    return {"input_ids": ids, "labels": ids}


def _hf_loss(model, batch):
    return model(**batch).loss


def _tokens(model, batch) -> int:
    if "input_ids" in batch:
        return batch["input_ids"].numel()
    config = model.config
    return batch["pixel_values"].shape[0] * ((config.image_size // config.patch_size) ** 2 + 1)


def _step(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach()


def _measure(model, batch, loss_fn, warmup, steps):
    """(loss of the first step, grads after it, peak bytes, median step s, spread)."""
    loss = _step(model, batch, loss_fn)
    # on the host: a copy kept on the GPU would sit in every later row's peak (and in the plan's static bytes)
    grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}
    for _ in range(warmup - 1):
        _step(model, batch, loss_fn)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _step(model, batch, loss_fn)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    return loss, grads, peak, statistics.median(times), (min(times), max(times))


def _grad_diff(grads, reference) -> float:
    """The largest relative difference of any gradient (norm of the difference over the norm)."""
    worst = 0.0
    for name, ref in reference.items():
        got = grads.get(name)
        if got is None:
            return float("inf")
        scale = ref.float().norm().item() or 1.0
        worst = max(worst, (got.float() - ref.float()).norm().item() / scale)
    return worst


def run_model(name, build, warmup, steps, write, uniform=()):
    torch.manual_seed(0)
    model, batch, loss_fn = build()
    loss_fn = loss_fn or _hf_loss
    tokens = _tokens(model, batch)
    base = {"model": name, "class": type(model).__name__, "use_cache": getattr(model.config, "use_cache", None),
            "batch_shape": list(next(iter(batch.values())).shape), "tokens_per_step": tokens}

    def row(strategy, loss, grads, peak, step_s, spread, **extra):
        record = dict(base, strategy=strategy, peak_bytes=peak, peak_GiB=round(peak / GiB, 3), step_s=step_s,
                      step_s_min=spread[0], step_s_max=spread[1], tokens_per_s=tokens / step_s,
                      loss=float(loss), **extra)
        write(record)
        return record

    eager_loss, eager_grads, eager_peak, eager_s, spread = _measure(model, batch, loss_fn, warmup, steps)
    again_loss, again_grads, *_ = _measure(model, batch, loss_fn, 1, 1)
    eager = row("eager", eager_loss, eager_grads, eager_peak, eager_s, spread,
                eager_repeat_loss_equal=bool(torch.equal(again_loss, eager_loss)),
                eager_repeat_grad_diff=_grad_diff(again_grads, eager_grads))
    del again_grads

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_loss_value, hf_grads, hf_peak, hf_s, spread = _measure(model, batch, loss_fn, warmup, steps)
    model.gradient_checkpointing_disable()
    row("hf_full", hf_loss_value, hf_grads, hf_peak, hf_s, spread,
             loss_equal=bool(torch.equal(hf_loss_value, eager_loss)), grad_diff=_grad_diff(hf_grads, eager_grads))
    del hf_grads

    for spec in uniform:   # one treatment on every block, the plain head: treatments against each other
        remat.apply(model, spec)
        loss, grads, peak, step_s, spread = _measure(model, batch, loss_fn, warmup, steps)
        remat.remove(model)
        row(f"remat:{spec}", loss, grads, peak, step_s, spread, loss_equal=bool(torch.equal(loss, eager_loss)),
            grad_diff=_grad_diff(grads, eager_grads), vs_hf_full_speed=hf_s / step_s)
        del grads

    budgets = [("remat@half", eager_peak // 2)]
    if eager_peak // 2 > hf_peak:
        budgets.append(("remat@hf", hf_peak))
    for strategy, budget in budgets:
        started = time.perf_counter()
        try:
            plan = remat.plan(model, batch, budget, loss_fn=None if loss_fn is _hf_loss else loss_fn)
        except ValueError as e:
            write(dict(base, strategy=strategy, budget_bytes=int(budget), status="no plan", reason=str(e)[:400]))
            continue
        plan_s = time.perf_counter() - started
        remat.apply(model, plan)
        loss, grads, peak, step_s, spread = _measure(model, batch, loss_fn, warmup, steps)
        remat.remove(model)
        extra = {}
        if plan.head != "plain":   # the chunked head sums the loss in another order: blocks checked apart
            remat.apply(model, remat.Plan(dict(plan.blocks), head="plain"))
            own_loss, own_grads, *_ = _measure(model, batch, loss_fn, 1, 1)
            remat.remove(model)
            extra = {"blocks_with_own_head_loss_equal": bool(torch.equal(own_loss, eager_loss)),
                     "blocks_with_own_head_grad_diff": _grad_diff(own_grads, eager_grads)}
            del own_grads
        row(strategy, loss, grads, peak, step_s, spread, budget_bytes=int(budget), plan=plan.summary(),
            head=plan.head, predicted_peak_bytes=plan.notes.get("predicted_peak_bytes"),
            predicted_step_s=plan.notes.get("predicted_step_s"), plan_s=plan_s,
            under_budget=peak <= budget, loss_equal=bool(torch.equal(loss, eager_loss)),
            loss_rel_diff=abs(float(loss) - float(eager_loss)) / abs(float(eager_loss)),
            grad_diff=_grad_diff(grads, eager_grads), vs_hf_full_speed=hf_s / step_s,
            vs_hf_full_memory=peak / hf_peak, vs_eager_speed=eager["step_s"] / step_s, **extra)
        del grads
    del model, batch, eager_grads
    gc.collect()
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--only", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--uniform", default="", help="comma-separated specs also measured on every block "
                        "(e.g. selective,mlp), each against eager and HF checkpointing")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)   # warn: a kernel without a deterministic
    os.makedirs(args.out, exist_ok=True)                       # version is reported by eager-vs-eager
    path = os.path.join(args.out, "heldout.jsonl")
    with open(path, "w") as sink:
        sink.write(json.dumps({"environment": environment(torch.device("cuda"))}) + "\n")

        def write(record):
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                     if k not in ("class", "batch_shape", "tokens_per_step")}
            print(json.dumps(shown), flush=True)

        for name in args.only.split(","):
            try:
                run_model(name, MODELS[name], args.warmup, args.steps, write,
                          uniform=[u for u in args.uniform.split(",") if u])
            except Exception as e:   # one model failing must not lose the others' rows
                write({"model": name, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:500]}"})
                gc.collect()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
