"""Every shell command the README and docs/ give (in ```bash blocks and in inline code) names what exists: a
``relbias`` subcommand whose parser takes the arguments as written, a script under ``benchmarks/`` or ``examples/``
that defines every ``--option`` the command passes, a test file that exists. Run in the README's virtual
environment (its first lines say so), each of them starts as written; the slow ones are not run here."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from relbias.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASH = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
PREFIXES = (".venv/bin/", "python -m ", "python ", "torchrun ", "relbias ")


def _words(command: str) -> list[str]:
    """The command's words up to a comment, a pipe or a chain (``&&``, ``;``)."""
    words = shlex.split(command, comments=True)
    for stop in ("&&", "|", ";", "||", ">", "2>&1"):
        if stop in words:
            words = words[: words.index(stop)]
    return words


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        lines = [line for block in BASH.findall(text) for line in block.replace("\\\n", " ").splitlines()]
        prose = BASH.sub("", text)
        lines += [code for code in INLINE.findall(prose) if code.startswith(PREFIXES)]
        for line in lines:
            line = line.strip()
            for part in re.split(r"\s&&\s", line):
                part = re.sub(r"^(\S+=\S+\s+)+", "", part.strip())  # environment assignments
                if part.startswith(".venv/bin/"):
                    part = part[len(".venv/bin/"):]
                prefixes = ("python benchmarks/", "python examples/", "relbias ", "python -m pytest", "torchrun ")
                if "..." not in part and part.startswith(prefixes):
                    found.append((f"{page.relative_to(ROOT)}: {part}", _words(part)))
    return found


COMMANDS = _commands()


def _script(words: list[str]) -> tuple[Path, list[str]]:
    """The script a ``python`` or ``torchrun`` command runs, and its arguments."""
    index = next(i for i, word in enumerate(words) if word.endswith(".py"))
    return ROOT / words[index], words[index + 1:]


def test_the_pages_give_commands():
    kinds = {words[0] if words[0] != "python" else words[1].split("/")[0] for _, words in COMMANDS}
    assert {"relbias", "benchmarks", "torchrun"} <= kinds, kinds


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_the_command_names_what_exists(where, words):
    if words[0] == "relbias":
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            try:
                build_parser().parse_args(words[1:])
            except SystemExit as exit_:
                assert exit_.code == 0, f"{where}: {errors.getvalue().strip()}"  # --help exits 0
        return
    if words[:3] == ["python", "-m", "pytest"]:
        paths = [word.split("::")[0] for word in words[3:] if not word.startswith("-")]
        missing = [path for path in paths if not (ROOT / path).exists()]
        assert not missing, f"{where}: no {missing}"
        return
    script, arguments = _script(words)
    assert script.is_file(), f"{where}: no {script.relative_to(ROOT)}"
    source = script.read_text(encoding="utf-8")
    for option in (word.split("=")[0] for word in arguments if word.startswith("--")):
        assert f'"{option}"' in source, f"{where}: {script.name} defines no {option}"
