"""The arguments every GPU benchmark script here shares: model, shapes, steps, output folder."""
import argparse
import os


def bench_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help="preset or config.json path")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p
