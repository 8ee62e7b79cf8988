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


#: The integration modules by layer: the front door, the ALiBi dispatcher, the families, the shared helpers.
_INTEGRATION_LAYERS = (
    {"transformers"},
    {"alibi_decoders"},
    {"t5", "longt5", "mpnet", "bloom", "mpt", "falcon"},
    {"common", "patches", "t5_attention", "alibi_common", "compiled_masks", "masks", "hidden_rows", "loading",
     "longt5_attention", "longt5_parallel", "sharded_stacks", "t5_tensor_parallel", "__init__"},
)


def test_integration_imports_point_one_way():
    """``relbias.integrations``: the front door imports the families, the families the shared helpers, never back,
    so the modules form no import circle (a module imports only modules of a layer below its own, helpers aside)."""
    import ast
    import graphlib
    from pathlib import Path

    folder = Path(relbias.__file__).parent / "integrations"
    layer = {name: depth for depth, names in enumerate(_INTEGRATION_LAYERS) for name in names}
    assert set(layer) == {path.stem for path in folder.glob("*.py")}, "a new module needs a layer here"
    wrong, graph = [], {}
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
                for target in targets:
                    graph.setdefault(path.stem, set()).add(target)
                    helpers = layer[target] == layer[path.stem] == len(_INTEGRATION_LAYERS) - 1
                    if layer[target] <= layer[path.stem] and not helpers:
                        wrong.append(f"{path.stem} -> {target}")
    assert wrong == []
    tuple(graphlib.TopologicalSorter(graph).static_order())  # CycleError where the helpers import in a circle
