"""``python -m relbias ...``: the ``relbias`` command (:mod:`relbias.cli.main`), for environments without the
console script on ``PATH`` (e.g. ``python -m relbias build``)."""

from __future__ import annotations

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
