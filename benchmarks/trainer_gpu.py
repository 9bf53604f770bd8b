"""remat where users train, on a GPU (issue 13): the Trainer callback on a partly filled GPU, and QLoRA.

Two runs, each written as JSON lines to ``--out/trainer.jsonl``:

1. ``trainer``: the bench model (a preset, bf16 weights) trained by a ``transformers.Trainer``
   with ``TrainingArguments(bf16=True)`` and otherwise default arguments, for ``--steps``
   optimizer steps of ``--batch`` x ``--seq`` tokens, on a GPU of which ``--fill`` is taken by
   another allocation first. Two trainers, one after the other, same weights and data:
   ``gradient_checkpointing=True`` (Hugging Face's), and ``RematCallback()`` with no budget
   (it plans from the first real batch at 90% of what the device can give). Recorded per
   run: the peak (``max_memory_allocated``, the filler excluded) against the free memory,
   the median step time of the steps after the first two (the Trainer's own optimizer step
   included) and tokens/s, the losses of every step, the plan.
2. ``qlora``: the same preset saved with random weights, loaded back with
   ``BitsAndBytesConfig(load_in_4bit=True, nf4, bf16 compute)``, LoRA adapters (r=16, every
   linear of the blocks) from PEFT; a plain loop (forward, backward, AdamW on the adapters)
   without checkpointing, with Hugging Face's, and with ``remat.plan`` at half of the
   measured peak without checkpointing. Peak, median step time, the first loss, the plan and
   its prediction.

Needs ``bitsandbytes`` for the second run (carried as a wheel on a machine without a registry).
Run: ``PYTHONPATH=src python benchmarks/trainer_gpu.py --out DIR [--run trainer,qlora]``.
"""
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _args import bench_parser  # noqa: E402

import remat  # noqa: E402
from remat.presets import build_model, load_config  # noqa: E402
from remat.prove.bench import environment  # noqa: E402
from remat.units import parse_size  # noqa: E402

GiB = 2 ** 30


class _Steps:
    """A TrainerCallback that times each optimizer step on the device and keeps the losses."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                outer._started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                outer.times.append(time.perf_counter() - outer._started)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    outer.losses.append(logs["loss"])

        self.callback = Callback()
        self.times, self.losses, self._started = [], [], 0.0


def _dataset(vocab, rows, seq, seed=3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def run_trainer(args, write):
    from transformers import Trainer, TrainingArguments

    from remat.integrations.hf import RematCallback
    config = load_config(args.model)
    filler = torch.empty(parse_size(args.fill), dtype=torch.uint8, device="cuda")
    free, total = torch.cuda.mem_get_info()
    data = _dataset(config.vocab_size, args.batch * args.steps, args.seq)
    for name in ("hf_gradient_checkpointing", "remat_callback"):
        model = build_model(config, device="cuda", dtype=torch.bfloat16)
        steps = _Steps()
        messages = []
        callbacks = [steps.callback]
        if name == "remat_callback":
            callbacks.append(RematCallback(say=messages.append))
        training = TrainingArguments(output_dir=tempfile.mkdtemp(), bf16=True, per_device_train_batch_size=args.batch,
                                     max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no",
                                     gradient_checkpointing=name == "hf_gradient_checkpointing")
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        record = {"run": "trainer", "strategy": name, "model": args.model, "batch": args.batch, "seq": args.seq,
                  "filler_bytes": filler.numel(), "free_bytes_at_start": free, "total_bytes": total}
        try:
            trainer.train()
            peak = torch.cuda.max_memory_allocated() - filler.numel()
            median = statistics.median(steps.times[2:])
            plan = remat.current_plan(model)
            record.update(status="ok", peak_bytes=peak, peak_GiB=peak / GiB, under_free=peak <= free,
                          step_s=median, step_times=steps.times, tokens_per_s=args.batch * args.seq / median,
                          losses=steps.losses, plan=plan.summary() if plan is not None else None,
                          predicted_peak_bytes=plan.notes.get("predicted_peak_bytes") if plan is not None else None,
                          messages=messages)
        except torch.OutOfMemoryError as e:
            record.update(status="oom", reason=str(e).splitlines()[0][:300], messages=messages)
        write(record)
        del model, trainer, steps
        gc.collect()
        torch.cuda.empty_cache()
    del filler
    torch.cuda.empty_cache()


def _qlora_model(args, folder):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.bfloat16,
                                                device_map={"": 0})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(base, lora).train()


def _loop(model, batch, steps, warmup=2):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    first = None
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        first = float(loss) if first is None else first
    return first, torch.cuda.max_memory_allocated(), statistics.median(times[warmup:])


def run_qlora(args, write):
    config = load_config(args.model)
    folder = tempfile.mkdtemp()
    build_model(config, device="cpu", dtype=torch.bfloat16).save_pretrained(folder)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).cuda()
    batch = {"input_ids": ids, "labels": ids}
    half = None
    for name in ("no_checkpointing", "hf_gradient_checkpointing", "remat@half"):
        model = _qlora_model(args, folder)
        record = {"run": "qlora", "strategy": name, "model": args.model, "batch": args.batch, "seq": args.seq,
                  "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
        try:
            if name == "hf_gradient_checkpointing":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.enable_input_require_grads()
            if name == "remat@half":
                started = time.perf_counter()
                plan = remat.plan(model, batch, half, optimizer="adamw")
                record.update(budget_bytes=half, plan=plan.summary(), plan_s=time.perf_counter() - started,
                              predicted_peak_bytes=plan.notes.get("predicted_peak_bytes"),
                              predicted_step_s=plan.notes.get("predicted_step_s"))
                remat.apply(model, plan)
            loss, peak, step_s = _loop(model, batch, args.steps)
            record.update(status="ok", loss=loss, peak_bytes=peak, peak_GiB=peak / GiB, step_s=step_s,
                          tokens_per_s=ids.numel() / step_s)
            if name == "remat@half":
                record["under_budget"] = peak <= half
            if name == "no_checkpointing":
                half = peak // 2
        except (torch.OutOfMemoryError, ValueError) as e:
            record.update(status="oom" if isinstance(e, torch.OutOfMemoryError) else "no plan",
                          reason=str(e).splitlines()[0][:400])
        write(record)
        del model
        gc.collect()
        torch.cuda.empty_cache()


def main():
    parser = bench_parser(__doc__)
    parser.set_defaults(steps=8)
    parser.add_argument("--fill", default="40GiB", help="GPU memory taken by another allocation first (trainer run)")
    parser.add_argument("--run", default="trainer,qlora")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "trainer.jsonl"), "w") as sink:
        sink.write(json.dumps({"environment": environment(torch.device("cuda"))}) + "\n")

        def write(record):
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            print(json.dumps({k: v for k, v in record.items() if k not in ("step_times", "messages")}), flush=True)

        for run in args.run.split(","):
            {"trainer": run_trainer, "qlora": run_qlora}[run](args, write)


if __name__ == "__main__":
    sys.exit(main())
