"""The bias contract (relbias.RelativeBias): a new family is one class plus one register_family call, and
every registered family answers num_parameters, describe(), distance() and parameter_key() through it."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relbias
from relbias import RelativeBias, T5Bias
from relbias.biases import FAMILIES, make_bias, register_family
from relbias.cli import inspect
from relbias.cli.main import build_parser

BUILT_IN = ["none", "offset", "t5", "alibi", "kerple_log", "kerple_power", "fire"]


class LinearDecayBias(RelativeBias):
    """A family written for this test: ``PE_h(i, j) = -softplus(w_h) * distance(i - j)``, one slope per head."""

    default_convention = "additive"
    distance_only = True

    def __init__(self, num_heads, *, bidirectional=False):
        super().__init__()
        self.num_heads, self.bidirectional = num_heads, bidirectional
        self.raw_slope = nn.Parameter(torch.linspace(-2.0, 0.0, num_heads))

    def offset_values(self, offsets):
        slope = F.softplus(self.raw_slope).reshape(-1, *([1] * offsets.dim()))  # (H, 1, ..., 1)
        return -slope * self.distance(offsets).to(slope.dtype)

    def describe(self):
        with torch.no_grad():
            return {"slopes": F.softplus(self.raw_slope).tolist()}


@pytest.fixture
def linear_decay():
    """The test family registered as "linear_decay" for one test, then removed again."""
    register_family(
        "linear_decay",
        lambda *, num_heads, max_len, bidirectional: LinearDecayBias(num_heads, bidirectional=bidirectional),
    )
    try:
        yield "linear_decay"
    finally:
        FAMILIES.pop("linear_decay")


def test_built_in_families_register_themselves_in_order():
    assert list(FAMILIES) == BUILT_IN  # extrapolate runs them in this order by default
    for name in BUILT_IN[1:]:  # each family module registers itself; "none" lives in the registry
        module = FAMILIES[name].__module__
        assert module == f"relbias.biases.{name.split('_')[0]}", (name, module)
    with pytest.raises(ValueError, match="already registered"):
        register_family("t5", lambda **kwargs: None)


@pytest.mark.parametrize("is_causal", [True, False])
def test_a_new_family_in_one_class_works_everywhere(linear_decay, is_causal, small_tiles):
    bias = make_bias(linear_decay, num_heads=3, max_len=16, bidirectional=not is_causal)
    assert isinstance(bias, LinearDecayBias) and list(FAMILIES)[-1] == linear_decay
    q, k, v = (torch.randn(2, 3, 20, 4, requires_grad=True) for _ in range(3))
    outs = {
        backend: relbias.attention(q, k, v, bias=bias, is_causal=is_causal, backend=backend)
        for backend in ("reference", "blockwise")
    }
    assert torch.allclose(outs["blockwise"], outs["reference"], atol=1e-5)
    weights = torch.randn_like(outs["reference"])
    grads = {name: torch.autograd.grad((out * weights).sum(), [q, k, v, bias.raw_slope]) for name, out in outs.items()}
    for a, b in zip(grads["blockwise"], grads["reference"]):
        assert torch.allclose(a, b, atol=1e-5)

    assert bias.num_parameters == 3
    slopes = F.softplus(torch.linspace(-2.0, 0.0, 3)).tolist()
    assert bias.describe() == {"slopes": pytest.approx(slopes)}
    # pairs at the same distance share the value: both sides of the query when bidirectional
    sharers = {tuple(p) for p in bias.pairs_sharing(5, 3, 8).tolist()}
    expected = {(i, j) for i in range(8) for j in range(8) if i - j == 2 or (not is_causal and j - i == 2)}
    assert sharers == expected


def test_inspect_describes_a_new_family_through_the_contract(linear_decay):
    argv = ["inspect", "--family", linear_decay, "--num-heads", "3", "--max-len", "6", "--causal", "--no-plots"]
    args = build_parser().parse_args(argv)
    info, curves, heatmaps = inspect.describe(args)
    slopes = F.softplus(torch.linspace(-2.0, 0.0, 3))
    assert info["class"] == "LinearDecayBias" and info["default_convention"] == "additive"
    assert info["parameter_count"] == 3 and info["bucket_map"] is None
    assert info["constants"] == {"slopes": pytest.approx(slopes.tolist())}
    assert info["bias_vs_offset"]["offsets"] == list(range(6))
    assert torch.allclose(curves, -slopes[:, None] * torch.arange(6.0))
    assert heatmaps.shape == (3, 6, 6) and bool(heatmaps[:, 0, 1:].isnan().all())  # future keys masked
    json.dumps(info)


# (family, bidirectional) -> learnable scalars with H = 3, max_len = 8
PARAMETERS = {
    ("offset", True): (2 * 8 - 1) * 3,
    ("offset", False): 8 * 3,
    ("t5", True): 32 * 3,
    ("t5", False): 32 * 3,
    ("alibi", True): 0,
    ("alibi", False): 0,
    ("kerple_log", False): 2 * 3,
    ("kerple_power", True): 2 * 3,
    ("fire", False): 2 * 32 + 32 * 3 + 3 + 2,  # Linear(1, 32), Linear(32, 3), c, L
}


@pytest.mark.parametrize("family, bidirectional", sorted(PARAMETERS))
def test_num_parameters_of_every_family(family, bidirectional):
    bias = make_bias(family, num_heads=3, max_len=8, bidirectional=bidirectional)
    assert bias.num_parameters == PARAMETERS[family, bidirectional] == sum(p.numel() for p in bias.parameters())


def test_num_parameters_counts_frozen_tables_and_not_buffers():
    bias = T5Bias(8)
    assert bias.num_parameters == 32 * 8
    bias.weight.requires_grad_(False)
    assert bias.num_parameters == 32 * 8  # a property of the family and its settings, not of a training setup
    assert relbias.ALiBiBias(8).num_parameters == 0  # the slopes are a buffer
    assert relbias.KerpleLogBias(8).num_parameters == 2 * 8
    assert relbias.FunctionBias(nn.Linear(1, 1)).num_parameters == 2  # an nn.Module function's parameters


def test_describe_gives_each_family_its_constants():
    def described(family, **options):
        return make_bias(family, num_heads=3, max_len=8, bidirectional=True, **options).describe()

    assert described("offset") == {"max_len": 8, "max_table_offset": 7, "out_of_range": "error"}
    assert described("offset", out_of_range="clip")["out_of_range"] == "clip"
    assert described("t5") == {"num_buckets": 32, "max_distance": 128, "saturation_distance": 91}
    assert described("t5", num_buckets=16, max_distance=64)["num_buckets"] == 16
    assert described("alibi") == {"slopes": relbias.alibi_slopes(3).tolist()}
    log = described("kerple_log", init_r1=0.5, init_r2=[0.25, 0.5, 1.0])
    assert log == {"r1": pytest.approx([0.5] * 3), "r2": pytest.approx([0.25, 0.5, 1.0])}
    power = described("kerple_power", init_r1=1.0, init_r2=1.5)
    assert power == {"r1": pytest.approx([1.0] * 3), "r2": pytest.approx([1.5] * 3)}
    fire = described("fire", hidden_width=4, init_c=0.5, init_threshold=64.0)
    assert fire == {"c": pytest.approx(0.5), "threshold": pytest.approx(64.0), "hidden_width": 4, "eps": 1e-6}
    assert relbias.FunctionBias(nn.Identity()).describe() == {"function": "Identity"}
    assert relbias.FunctionBias(F.softplus).describe() == {"function": "softplus"}


@pytest.mark.parametrize("family", BUILT_IN[1:])
def test_describe_is_json_ready_and_does_not_repeat_the_common_attributes(family):
    constants = make_bias(family, num_heads=2, max_len=8, bidirectional=False).describe()
    assert constants and json.loads(json.dumps(constants)) == constants
    assert not {"num_heads", "bidirectional", "default_convention", "offset_only", "num_parameters"} & set(constants)


@pytest.mark.parametrize("family", ["alibi", "kerple_log", "kerple_power", "fire"])
def test_distance_rule_and_parameter_key_have_one_implementation(family):
    offsets = torch.arange(-3, 4)
    for bidirectional in (True, False):
        bias = make_bias(family, num_heads=2, max_len=8, bidirectional=bidirectional)
        assert type(bias).distance is RelativeBias.distance and type(bias).parameter_key is RelativeBias.parameter_key
        expected = offsets.abs() if bidirectional else torch.tensor([0, 0, 0, 0, 1, 2, 3])
        assert torch.equal(bias.distance(offsets), expected)
        key = bias.parameter_key(offsets)  # ALiBi / KERPLE: the distance; FIRE: the offset (it reads i too)
        assert torch.equal(key, offsets.abs() if bidirectional and bias.distance_only else offsets)
