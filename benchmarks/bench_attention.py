"""Time and peak memory of relative-bias attention backends against bias-free SDPA.

The same measurement as ``relbias bench`` (see :mod:`relbias.cli.bench` for the methods and how time and
memory are measured). Examples::

    python benchmarks/bench_attention.py --n 2048 4096 8192 --mode fwd
    python benchmarks/bench_attention.py --n 4096 --mode fwdbwd --methods structured --json out.json
"""

from __future__ import annotations

import argparse
import sys

from relbias.cli.bench import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), measure, print; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
