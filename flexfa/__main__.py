"""``python -m flexfa <command>``: a table of subcommands, each a ``main(argv)`` in its own module."""
from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help); modules are imported only when their command runs
COMMANDS = {
    "demo": ("flexfa.demo", "run the variant demo (GPU if present, else CPU interpreter)"),
    "info": ("flexfa.info", "print versions, GPU, cache location and size"),
    "cache": ("flexfa.runtime.cli", "the kernel cache: `cache path|size|clear|prune`"),
    "compile-check": ("flexfa.compile_check",
                      "compile every template for GPU architectures without a GPU"),
    "bench": ("flexfa.bench", "benchmark flexfa against torch FlexAttention and SDPA (GPU)"),
}


def usage() -> str:
    lines = ["usage: python -m flexfa <command> [args]", "       python -m flexfa --version", "",
             "commands:"]
    lines += [f"  {name:<14} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"flexfa {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
