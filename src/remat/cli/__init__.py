"""The ``remat`` command line: one subcommand per module in this package.

Only the chosen subcommand's module is imported, so ``remat --help`` imports neither
torch nor transformers and answers at once. Each command module defines ``HELP`` (one
line), ``EXAMPLES``, ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import sys
from importlib import import_module

# name -> (module, one-line help); kept here so the top-level help needs no imports
COMMANDS = {
    "bench": ("remat.cli.bench", "measure remat's plans beside the stock strategies"),
    "plan": ("remat.cli.plan", "the fastest plan that fits a memory budget"),
    "estimate": ("remat.cli.estimate", "predicted peak and speed of every strategy"),
    "env": ("remat.cli.env", "versions, GPU and host memory limits"),
}


def _top_level_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: remat <command> [options]", "",
             "Make PyTorch training fit in GPU memory at the highest speed memory allows.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`remat <command> --help` shows a command's options and examples.",
              "Models: a preset (llama-tiny, llama-1b, llama-8b, llama-70b, qwen-1.5b, qwen-tiny) "
              "or a path to a Hugging Face config.json."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_level_help())
        return 0
    if argv[0] in ("-V", "--version"):
        from remat import __version__
        print(f"remat {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"remat: unknown command {name!r}\n\n{_top_level_help()}", file=sys.stderr)
        return 2
    module = import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"remat {name}", description=module.HELP,
                                     epilog=module.EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"remat {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
