"""What a new user reaches after ``import relbias`` (fresh-user walkthrough): the subpackages the README names."""

import subprocess
import sys

import relbias


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


def test_no_module_below_the_command_line_imports_it():
    """The command line (relbias.cli) sits on top of the library: only it and ``python -m relbias`` import it."""
    import ast
    from pathlib import Path

    root = Path(relbias.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if relative.parts[0] == "cli" or relative == Path("__main__.py"):
            continue
        package = ["relbias", *relative.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                names = [".".join([*base, node.module or ""]).strip(".")]
                names += [f"{names[0]}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name == "relbias.cli" or name.startswith("relbias.cli.") for name in names):
                offenders.append(str(relative))
    assert offenders == []
