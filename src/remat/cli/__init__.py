"""The ``remat`` command line: one subcommand per module in this package.

Only the chosen subcommand's module is imported, so ``remat --help`` imports neither
torch nor transformers and answers at once. Each command module defines ``HELP`` (one
line), ``EXAMPLES``, ``add_arguments(parser)`` and ``run(args) -> int``.

Errors: every mistake a user can make (a bad option, a bad number, a missing or broken
config file, a budget nothing fits, transformers not installed) ends the command with
one line ``remat <command>: error: <what was wrong and what to do>`` on stderr and exit
status 2, never a traceback; argparse's own errors are turned into the same form
rather than exiting the process, so :func:`main` can be called in-process and returns
the status. Output meant for scripts (``--json``) is the only thing on stdout; progress
goes to stderr.

A value that starts with ``-`` and a digit (``--budget -5GiB``) is taken as the
option's value, as a user means it, and then refused by the option's own check;
argparse alone would read it as an unknown option.
"""
from __future__ import annotations

import argparse
import re
import sys
from importlib import import_module

# name -> (module, one-line help); kept here so the top-level help needs no imports
COMMANDS = {
    "bench": ("remat.cli.bench", "measure remat's plans beside the stock strategies"),
    "plan": ("remat.cli.plan", "the fastest plan that fits a memory budget"),
    "estimate": ("remat.cli.estimate", "predicted peak and speed of every strategy"),
    "doctor": ("remat.cli.doctor", "the problems of a training setup, worst first"),
    "verify": ("remat.cli.verify", "a treatment's loss and gradients against the untouched model's"),
    "env": ("remat.cli.env", "versions, GPU and host memory limits"),
}
# optional dependencies whose absence is the user's to fix, not a bug to show a traceback for
_OPTIONAL = ("transformers",)
_NEGATIVE_NUMBER = re.compile(r"^-\.?[0-9]")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and sys.exit; main() reports and returns 2
        raise _UsageError(message)


def _top_level_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: remat <command> [options]", "",
             "Make PyTorch training fit in GPU memory at the highest speed memory allows.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`remat <command> --help` shows a command's options and examples.",
              "Models: a preset (llama-tiny, llama-1b, llama-8b, llama-70b, qwen-1.5b, qwen-tiny), "
              "a Hugging Face JSON config file of any name, or a folder holding config.json."]
    return "\n".join(lines)


def _negative_values(argv: list) -> list:
    """``--budget -5GiB`` -> ``--budget=-5GiB``, so that argparse takes it as the value."""
    out = []
    for token in argv:
        if out and _NEGATIVE_NUMBER.match(token) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def make_parser(name: str, module) -> argparse.ArgumentParser:
    parser = _Parser(prog=f"remat {name}", description=module.HELP, epilog=module.EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return parser


def main(argv=None) -> int:
    """Run one ``remat`` command; returns the exit status (0, or 2 after a one-line error)."""
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
        print(f"remat: error: unknown command {name!r}; expected one of {', '.join(COMMANDS)}\n\n"
              f"{_top_level_help()}", file=sys.stderr)
        return 2
    module = import_module(COMMANDS[name][0])
    parser = make_parser(name, module)
    try:
        args = parser.parse_args(_negative_values(argv[1:]))
    except _UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"remat {name}: error: {e}; see `remat {name} --help` for the options and examples",
              file=sys.stderr)
        return 2
    except SystemExit as e:  # --help prints and exits 0
        return e.code if isinstance(e.code, int) else 0
    try:
        return int(module.run(args) or 0)
    except ImportError as e:
        if e.name not in _OPTIONAL:
            raise
        print(f"remat {name}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file remat was asked to read or write
        print(f"remat {name}: error: {e}; check the path and its permissions", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"remat {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
