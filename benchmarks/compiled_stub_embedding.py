"""Does a compiled step with stubbed blocks compile the embeddings as the real compiled step does? (CPU)

The compiled profile measures the embeddings and the head on a step whose blocks are stubs, each a
``torch.compiler.disable`` frame (``remat.profiling._head._Stubs``), with the model compiled around
them. On the H100 (``results/compiled_head/compiled_head_probe_h100_1.jsonl``) every compiled plan
with the chunked head peaked at 4.211 GB whatever its blocks' treatment, 1.01 GB over what the
profile predicts: about one fp32 ``[vocab x hidden]`` tensor of Llama-3.2-1B (1.05 GB), the buffer
inductor's ``embedding_dense_backward`` sums a bf16 embedding's gradient in.

This script shows on the CPU whether that buffer is in the compiled code of each step: a tiny bf16
Llama with tied embeddings (vocab 1000, hidden 96), ``remat.apply(model, "full")`` with the plain or
the chunked head, compiled with inductor, one step; then the same with every block's forward a
``torch.compiler.disable`` stub as the profile's. It counts, in inductor's generated code, the
``[vocab x hidden]`` buffers by dtype, the generated kernels that compute an embedding or its
backward, and the source functions dynamo traced into graphs.

    PYTHONPATH=src python benchmarks/compiled_stub_embedding.py --out DIR   # about a minute on 2 cores

Writes ``compiled_stub_embedding.json`` into ``--out`` and prints a table.
"""
import argparse
import json
import os
import re
import subprocess
import sys

VOCAB, HIDDEN = 1000, 96
CASES = ("plain", "plain-stub", "chunked", "chunked-stub")

STEP = f"""
import torch, remat
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size={VOCAB}, hidden_size={HIDDEN}, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
model = LlamaForCausalLM(config).to(torch.bfloat16).train()
ids = torch.randint(0, {VOCAB}, (2, 64))
case = {{case!r}}
chunked = case.startswith("chunked")
remat.apply(model, "full", head="chunked" if chunked else None, chunk_tokens=64 if chunked else None)
if case.endswith("stub"):
    zero = torch.zeros((), dtype=torch.bfloat16, requires_grad=True)

    @torch.compiler.disable
    def stub(hidden_states, *args, **kwargs):
        return hidden_states + zero
    for layer in model.model.layers:
        layer.forward = stub
torch.compile(model)(input_ids=ids, labels=ids).loss.backward()
"""


def run(case: str) -> dict:
    env = dict(os.environ, TORCH_LOGS="output_code,graph_code")
    done = subprocess.run([sys.executable, "-c", STEP.format(case=case)], env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode:
        return dict(case=case, error=log[-2000:])
    shape = rf"empty_strided_\w+\(\({VOCAB}, {HIDDEN}\), \({HIDDEN}, 1\), torch\.(\w+)\)"
    buffers = {}
    for dtype in re.findall(shape, log):
        buffers[dtype] = buffers.get(dtype, 0) + 1
    functions = sorted({f"{m.group(1).split('/')[-1]}:{m.group(2)}"
                        for m in re.finditer(r"# File: \S+?/([\w/]+\.py):\d+ in (\w+)", log)})
    kernels = sorted(set(re.findall(r"\b(?:cpp|triton)_\w*embedding\w*", log)))
    return dict(case=case, vocab_by_hidden_buffers=buffers, embedding_kernels=kernels, traced_functions=functions)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch
    import transformers
    rows = [run(case) for case in CASES]
    with open(os.path.join(args.out, "compiled_stub_embedding.json"), "w") as out:
        json.dump(dict(torch=torch.__version__, transformers=transformers.__version__, rows=rows), out, indent=1)
    print(f"{'case':<14} {'[vocab x hidden] buffers in the compiled code':<48} embedding compiled")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<14} error: {r['error'][-200:]}")
            continue
        found = ", ".join(f"{n} {d}" for d, n in sorted(r["vocab_by_hidden_buffers"].items())) or "none"
        print(f"{r['case']:<14} {found:<48} {'yes' if r['embedding_kernels'] else 'no'}")


if __name__ == "__main__":
    main()
