"""``group=`` / ``process_group=`` take a process group or a 1-D DeviceMesh (a named dimension of a larger mesh), and
refuse anything else by name. One process: a gloo group of one rank (``file://`` rendezvous in a fresh folder,
destroyed after the module), a (1, 1) ("dp", "cp") mesh on it."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import relbias
from relbias.distributed import context_parallel_attention, gather_sequence
from relbias.distributed.groups import resolve_group
from relbias.nn import MultiheadAttention

from .._tolerance import assert_rounding_close


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    init = tmp_path_factory.mktemp("groups") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
    finally:
        dist.destroy_process_group()


def test_a_mesh_dimension_is_its_process_group(mesh):
    assert resolve_group(mesh["cp"]) is mesh["cp"].get_group()
    assert resolve_group(None) is None and resolve_group(dist.group.WORLD) is None


def test_a_two_dimensional_mesh_is_refused_with_its_dimensions(mesh):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"1-D DeviceMesh.*2-D mesh \(dp=1, cp=1\)"):
        context_parallel_attention(q, q, q, group=mesh)
    with pytest.raises(ValueError, match="process_group takes a 1-D DeviceMesh"):
        MultiheadAttention(8, 2, process_group=mesh)


@pytest.mark.parametrize("group", ["cp", 3, object()])
def test_other_types_are_refused_by_name(mesh, group):
    with pytest.raises(TypeError, match="group must be None, a torch.distributed ProcessGroup or a 1-D DeviceMesh"):
        context_parallel_attention(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), group=group)
    with pytest.raises(TypeError, match="process_group must be None"):
        MultiheadAttention(8, 2, process_group=group)


def test_sync_bias_grads_must_be_a_bool(mesh):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="sync_bias_grads must be a bool, got 1"):
        context_parallel_attention(q, q, q, group=mesh["cp"], sync_bias_grads=1)
    with pytest.raises(TypeError, match="cp_sync_bias_grads must be a bool"):
        MultiheadAttention(8, 2, process_group=mesh["cp"], cp_sync_bias_grads="no")


@pytest.mark.parametrize("sync_bias_grads", [True, False])
def test_a_mesh_dimension_runs_context_parallel_attention(mesh, sync_bias_grads):
    """On one rank the result and every gradient equal single-device attention, whichever the gradient sync."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    bias = relbias.T5Bias(num_heads=4, bidirectional=False)
    out = context_parallel_attention(q, k, v, bias=bias, is_causal=True, group=mesh["cp"],
                                     sync_bias_grads=sync_bias_grads)
    grads = torch.autograd.grad(out.square().sum(), [q, k, v, bias.weight])
    expected = relbias.attention(q, k, v, bias=bias, is_causal=True)
    expected_grads = torch.autograd.grad(expected.square().sum(), [q, k, v, bias.weight])
    assert_rounding_close(out, expected, n=32)
    for got, want in zip(grads, expected_grads):
        assert_rounding_close(got, want, n=2 * 32 * 32)  # the table's gradient sums over every (query, key) pair
    assert torch.equal(gather_sequence(k, group=mesh["cp"]), k)
