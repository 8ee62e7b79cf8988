"""Time and peak memory of relative-bias attention backends against bias-free SDPA.

The same measurement and table as ``relbias bench``: the engine is :mod:`relbias.benchmark` (the methods,
warm-up, repeats, minimum and median, the fresh-process memory probe, the busy-machine warning); the
options and the printing are :mod:`relbias.cli.bench`'s. Examples::

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
