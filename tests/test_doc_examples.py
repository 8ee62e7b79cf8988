"""Every Python example in the README and in docs/ runs as written (its ```python blocks, in order, one namespace
per block); the context-parallel example runs the way its page says, on 2 gloo processes, and its result is checked
against single-process attention."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for number, code in enumerate(BLOCK.findall(page.read_text(encoding="utf-8")), 1):
            found.append((f"{page.relative_to(ROOT)}#{number}", code))
    return found


BLOCKS = _blocks()
LOCAL = [(name, code) for name, code in BLOCKS if "init_process_group" not in code]
DISTRIBUTED = [(name, code) for name, code in BLOCKS if "init_process_group" in code]


def test_the_pages_hold_examples():
    names = {name.split("#")[0] for name, _ in BLOCKS}
    assert {"README.md", "docs/backends.md", "docs/hugging-face.md", "docs/context-parallel.md"} <= names, names


@pytest.mark.parametrize("name, code", LOCAL, ids=[name for name, _ in LOCAL])
def test_example_runs_as_written(name, code):
    if "transformers" in code:
        pytest.importorskip("transformers")
    exec(compile(code, name, "exec"), {"__name__": "__doc_example__"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(code: str) -> int:
    """The process count the block's own comment asks for (``--nproc-per-node N``), else 2."""
    found = re.search(r"--nproc-per-node (\d+)", code)
    return int(found.group(1)) if found else 2


# the context-parallel example's result, checked against relbias.attention on the full tensors before the group ends
CHECKS = {
    "q_full": textwrap.dedent("""
        reference = relbias.attention(q_full, k_full, v_full, bias=t5_bias, mask=keep_full, is_causal=True)
        error = (full - reference).abs().max().item()
        assert error < 1e-4, error
    """),
    # the LongT5 training step's global loss and every gradient, against one process on the whole batch
    "global_loss": textwrap.dedent("""
        torch.manual_seed(0)
        whole = transformers.LongT5ForConditionalGeneration(config).eval()
        want = whole(input_ids=ids, decoder_input_ids=decoder_ids, labels=labels).loss
        want.backward()
        assert abs(global_loss.item() - want.item()) < 1e-5, (global_loss.item(), want.item())
        for (name, p), (_, w) in zip(model.named_parameters(), whole.named_parameters()):
            torch.testing.assert_close(p.grad, w.grad, atol=1e-5, rtol=1e-4, msg=name)
    """),
}


@pytest.mark.parametrize("name, code", DISTRIBUTED, ids=[name for name, _ in DISTRIBUTED])
def test_distributed_example_runs_under_torchrun_environment(name, code, tmp_path):
    """Each rank runs the block as ``torchrun`` would start it (RANK, WORLD_SIZE, MASTER_ADDR/PORT on loopback,
    one thread); every rank must exit 0, and where the page says what the result equals, it is checked."""
    body, end = code.rsplit("dist.destroy_process_group()", 1)
    check = "".join(text for marker, text in CHECKS.items() if marker in code)
    script = tmp_path / "example.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + body + check + "print('example done')\n"
                      + "dist.destroy_process_group()" + end)
    port, world = str(_free_port()), _ranks(code)
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank}:\n{output[-3000:]}"
        assert "example done" in output, output[-3000:]
