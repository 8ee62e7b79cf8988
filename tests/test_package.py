"""What a new user reaches after ``import relbias`` (fresh-user walkthrough): the subpackages the README names."""

import subprocess
import sys


def test_subpackages_are_reachable_after_import_relbias_alone():
    code = ("import relbias; relbias.nn.MultiheadAttention; relbias.experiments.ByteLM; "
            "relbias.distributed.merge_partials; relbias.backends.BACKENDS; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-1000:]


def test_an_unknown_attribute_is_still_an_attribute_error():
    import pytest

    import relbias

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        relbias.nope  # noqa: B018
