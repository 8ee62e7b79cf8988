"""The ``relbias`` entry point itself."""

import subprocess
import sys


def test_a_closed_pipe_is_not_an_error():
    # `relbias buckets ... | head -1`: the reader leaves after one line of ~20000 (more than a pipe buffers)
    with subprocess.Popen(  # the with block closes stderr too (no ResourceWarning) and waits
        [sys.executable, "-m", "relbias.cli.main", "buckets", "--num-buckets", "20000", "--max-distance", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0
    assert first.startswith(b"bucket") and "Traceback" not in err
