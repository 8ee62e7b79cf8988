import pytest
import torch
from torch import nn

from relbias import FunctionBias


def test_wraps_a_function_of_the_offset_per_head():
    bias = FunctionBias(lambda o: torch.stack([o.float(), -2.0 * o.float()]), num_heads=2)
    out = bias(2, 3, query_start=4, key_start=1)  # offsets [[3, 2, 1], [4, 3, 2]]
    off = torch.tensor([[3.0, 2, 1], [4, 3, 2]])
    assert torch.equal(out, torch.stack([off, -2 * off]))


def test_module_functions_are_registered_and_trainable():
    mlp = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    bias = FunctionBias(lambda o: mlp(o.float().unsqueeze(-1)).squeeze(-1))
    assert list(bias.parameters()) == []  # a lambda hides the module ...
    bias = FunctionBias(_Wrapped(mlp))
    assert len(list(bias.parameters())) == 4  # ... a module is registered
    bias(3, 3).sum().backward()
    assert mlp[0].weight.grad is not None


class _Wrapped(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, offsets):
        return self.mlp(offsets.float().unsqueeze(-1)).squeeze(-1)


def test_wrong_output_shape_and_dtype_raise():
    with pytest.raises(ValueError, match=r"returned shape \(5,\)"):
        FunctionBias(lambda o: torch.zeros(5))(2, 2)
    with pytest.raises(ValueError, match="must return a float tensor"):
        FunctionBias(lambda o: o)(2, 2)
    with pytest.raises(TypeError, match="callable"):
        FunctionBias(3)
