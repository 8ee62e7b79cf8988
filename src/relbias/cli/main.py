"""``relbias`` entry point: one subcommand per module listed in ``SUBCOMMANDS``.

Each subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func=callable(args) -> int`` as the parser default. Modules are imported lazily by name so that a
missing optional extra only affects its own subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["build_parser", "main"]

#: (module under relbias.cli, one-line help) — the order they are listed in ``relbias --help``.
SUBCOMMANDS: list[str] = ["buckets", "inspect", "bench", "explain", "extrapolate", "build"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="relbias", description="Attention with relative position biases.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"relbias.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``relbias`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"relbias {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (e.g. `relbias buckets | head`): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that Python's exit-time flush does not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
