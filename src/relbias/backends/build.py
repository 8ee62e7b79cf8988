"""``python -m relbias.backends.build [--check]``: the ``relbias build`` command (:mod:`relbias.cli.build`), which
compiles the toeplitz backend's native kernels ahead of their first call."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from relbias.cli.main import main

    sys.exit(main(["build", *sys.argv[1:]]))
