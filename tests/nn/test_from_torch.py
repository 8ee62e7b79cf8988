"""MultiheadAttention.from_torch and torch state dicts: a trained torch.nn.MultiheadAttention carried over exactly,
what cannot be carried over refused by name; and the dtype check naming every mismatched input."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.nn import MultiheadAttention

from .._tolerance import assert_rounding_close

E, H, B = 16, 4, 2
MASKS = ["none", "padding", "bool_attn_mask", "float_masks", "causal"]


def _trained(**kwargs) -> torch.nn.MultiheadAttention:
    """torch's layer with every parameter drawn at random (torch starts its biases at 0, which would hide them)."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.5)
    return module


def _masks(kind: str, q_len: int, k_len: int):
    """(key_padding_mask, attn_mask, is_causal) for torch's call, in torch's conventions (True = padding / NOT
    allowed); every query keeps a visible key (torch gives NaN where it has none)."""
    padding = torch.zeros(B, k_len, dtype=torch.bool)
    padding[1, k_len - 2 :] = True
    if kind == "none":
        return None, None, False
    if kind == "padding":
        return padding, None, False
    if kind == "bool_attn_mask":
        mask = torch.rand(q_len, k_len) < 0.4
        mask[:, 0] = False
        return None, mask, False
    if kind == "float_masks":  # additive padding mask and per-head attn_mask
        return torch.zeros(B, k_len).masked_fill(padding, float("-inf")), torch.randn(B * H, q_len, k_len), False
    if kind == "causal":  # torch needs the mask with its is_causal hint
        return padding, torch.triu(torch.ones(q_len, k_len, dtype=torch.bool), diagonal=1), True
    raise AssertionError(kind)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False], ids=["proj_bias", "no_proj_bias"])
@pytest.mark.parametrize("kdim, vdim", [(None, None), (6, 10)], ids=["embed_dim", "other_kdim_vdim"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("need_weights", [False, True])
def test_converted_layer_equals_torch(batch_first, bias, kdim, vdim, masks, need_weights):
    module = _trained(bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    cross = kdim is not None and masks != "causal"  # other kdim/vdim: cross-attention to a longer memory
    layer = MultiheadAttention.from_torch(module, cross_attention=cross)
    q_len, k_len = 4, (7 if cross else 4)
    shape = (lambda n, f: (B, n, f)) if batch_first else (lambda n, f: (n, B, f))
    query = torch.randn(*shape(q_len, E))
    key, value = torch.randn(*shape(k_len, module.kdim)), torch.randn(*shape(k_len, module.vdim))
    kpm, attn_mask, is_causal = _masks(masks, q_len, k_len)
    expected, expected_weights = module(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask,
                                        is_causal=is_causal, need_weights=need_weights)
    # relbias applies is_causal by itself (torch reads it as a hint that attn_mask is causal)
    out, weights = layer(query, key, value, key_padding_mask=kpm, attn_mask=None if is_causal else attn_mask,
                         is_causal=is_causal, need_weights=need_weights)
    assert out.shape == expected.shape == (*shape(q_len, E),)
    assert_rounding_close(out, expected, n=max(E, module.kdim, module.vdim, k_len))
    if need_weights:
        assert weights.shape == expected_weights.shape == (B, q_len, k_len)
        assert_rounding_close(weights, expected_weights, n=max(E, module.kdim, k_len), scale=1.0)
    else:
        assert weights is None and expected_weights is None


def test_unbatched_and_per_head_weights_equal_torch():
    module = _trained()
    layer = MultiheadAttention.from_torch(module)
    x = torch.randn(5, E)
    kpm = torch.tensor([False, False, False, True, True])
    expected, expected_weights = module(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    out, weights = layer(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    assert weights.shape == expected_weights.shape == (H, 5, 5)
    assert_rounding_close(out, expected, n=E)
    assert_rounding_close(weights, expected_weights, n=E, scale=1.0)


def test_a_position_bias_is_added_to_torchs_scaled_scores_by_default():
    # convention "additive" by default: torch's (q.k) / sqrt(head_dim) plus the bias, unscaled -- what torch computes
    # with the bias as a float attn_mask. T5Bias' own convention ("t5", no scaling) would change the trained scores.
    module = _trained(batch_first=True)
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=1.0)
    layer = MultiheadAttention.from_torch(module, position_bias=bias)
    assert layer.convention == "additive" and layer.position_bias is bias
    x = torch.randn(B, 6, E)
    pe = bias(6, 6, query_start=0).detach()  # (H, 6, 6)
    expected, _ = module(x, x, x, attn_mask=pe.repeat(B, 1, 1), need_weights=False)
    out, _ = layer(x, x, x, need_weights=False)
    assert_rounding_close(out, expected, n=E)
    t5_scores = MultiheadAttention.from_torch(module, position_bias=bias, convention="t5")(x, x, x)[0]
    assert not torch.allclose(t5_scores, expected, atol=1e-3)  # the keyword is honoured, and differs


@pytest.mark.parametrize("kdim, vdim", [(None, None), (6, 10)], ids=["in_proj_weight", "q_k_v_proj_weight"])
def test_weights_are_copied_exactly_with_dtype_mode_and_requires_grad(kdim, vdim):
    module = _trained(kdim=kdim, vdim=vdim, dtype=torch.float64).eval()
    module.out_proj.weight.requires_grad_(False)
    layer = MultiheadAttention.from_torch(module)
    if kdim is None:
        q, k, v = module.in_proj_weight.detach().split(E)
    else:
        q, k, v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    assert (layer.kdim, layer.vdim, layer.batch_first) == (module.kdim, module.vdim, False)
    for mine, theirs in zip((layer.q_proj, layer.k_proj, layer.v_proj), (q, k, v)):
        assert torch.equal(mine.weight, theirs)  # a copy: bit-equal
    for mine, theirs in zip((layer.q_proj, layer.k_proj, layer.v_proj), module.in_proj_bias.detach().split(E)):
        assert torch.equal(mine.bias, theirs)
    assert torch.equal(layer.out_proj.weight, module.out_proj.weight)
    assert torch.equal(layer.out_proj.bias, module.out_proj.bias)
    assert all(p.dtype == torch.float64 for p in layer.parameters()) and not layer.training
    assert not layer.out_proj.weight.requires_grad
    assert layer.out_proj.bias.requires_grad and layer.q_proj.weight.requires_grad
    before = [p.detach().clone() for p in layer.parameters()]
    with torch.no_grad():  # no storage is shared: the torch layer stays free to change
        for parameter in module.parameters():
            parameter.add_(1.0)
    assert all(torch.equal(p, old) for p, old in zip(layer.parameters(), before))


def test_without_projection_biases_the_layer_has_none():
    layer = MultiheadAttention.from_torch(_trained(bias=False))
    assert all(proj.bias is None for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj))


@pytest.mark.parametrize("kdim, vdim", [(None, None), (6, 10)], ids=["in_proj_weight", "q_k_v_proj_weight"])
def test_load_state_dict_takes_torchs_state_dict(kdim, vdim):
    module = _trained(kdim=kdim, vdim=vdim)
    layer = MultiheadAttention(E, H, kdim=kdim, vdim=vdim)
    assert str(layer.load_state_dict(module.state_dict())) == "<All keys matched successfully>"
    converted = MultiheadAttention.from_torch(module)
    for (name, mine), (other, theirs) in zip(layer.state_dict().items(), converted.state_dict().items()):
        assert name == other and torch.equal(mine, theirs), name
    # the relbias layer's own state dict still loads as before
    again = MultiheadAttention(E, H, kdim=kdim, vdim=vdim)
    again.load_state_dict(layer.state_dict())
    assert torch.equal(again.v_proj.weight, layer.v_proj.weight)
    # with a position bias, only the bias' parameters are missing from torch's state dict
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16)
    with_bias = MultiheadAttention(E, H, kdim=kdim, vdim=vdim, position_bias=bias)
    result = with_bias.load_state_dict(module.state_dict(), strict=False)
    assert result.missing_keys == [f"position_bias.{name}" for name, _ in bias.named_parameters()]
    assert result.unexpected_keys == [] and torch.equal(with_bias.q_proj.weight, layer.q_proj.weight)


def test_load_state_dict_refuses_what_it_cannot_load():
    state = torch.nn.MultiheadAttention(E, H, add_bias_kv=True).state_dict()
    with pytest.raises(RuntimeError, match="bias_k: a torch.nn.MultiheadAttention state dict with add_bias_kv=True"):
        MultiheadAttention(E, H).load_state_dict(state, strict=False)  # an error even when not strict
    state = torch.nn.MultiheadAttention(E, H).state_dict()
    with pytest.raises(RuntimeError, match=r"in_proj_weight has shape \(48, 16\); expected 3 \* embed_dim = 24 rows"):
        MultiheadAttention(8, 2).load_state_dict(state)
    state["q_proj.weight"] = torch.zeros(E, E)
    with pytest.raises(RuntimeError, match="both q_proj.weight and torch's in_proj_weight"):
        MultiheadAttention(E, H).load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"size mismatch for k_proj.weight"):
        MultiheadAttention(E, H, kdim=6).load_state_dict(torch.nn.MultiheadAttention(E, H).state_dict())


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(add_bias_kv=True), r"add_bias_kv=True \(bias_k, bias_v"),
        (dict(add_zero_attn=True), r"add_zero_attn=True \(a zero key"),
        (dict(dropout=0.1), r"dropout=0.1 \(relbias' layer has no attention dropout"),
    ],
    ids=["add_bias_kv", "add_zero_attn", "dropout"],
)
def test_what_cannot_be_carried_over_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=r"cannot convert this torch.nn.MultiheadAttention: " + message):
        MultiheadAttention.from_torch(torch.nn.MultiheadAttention(E, H, **options))


def test_every_refusal_is_named_at_once_and_dropout_zero_converts():
    module = torch.nn.MultiheadAttention(E, H, dropout=0.25, add_zero_attn=True)
    with pytest.raises(ValueError, match=r"add_zero_attn=True .*; dropout=0.25"):
        MultiheadAttention.from_torch(module)
    module.add_zero_attn, module.dropout = False, 0.0  # as the message suggests, for a layer run without dropout
    assert isinstance(MultiheadAttention.from_torch(module), MultiheadAttention)


def test_inconsistent_or_foreign_torch_layers_are_refused():
    module = _trained()
    module.out_proj.bias = None
    with pytest.raises(ValueError, match="in_proj_bias is set but out_proj.bias is None"):
        MultiheadAttention.from_torch(module)
    module = _trained()
    module.out_proj.double()
    with pytest.raises(ValueError, match=r"parameters of several dtypes \['torch.float32', 'torch.float64'\]"):
        MultiheadAttention.from_torch(module)

    class WithExtra(torch.nn.MultiheadAttention):
        def __init__(self):
            super().__init__(E, H)
            self.gate = torch.nn.Parameter(torch.ones(E))

    with pytest.raises(ValueError, match=r"cannot convert module \(WithExtra\): its state dict has \['gate'\]"):
        MultiheadAttention.from_torch(WithExtra())


def test_bad_arguments_of_from_torch():
    module = _trained()
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention, got Linear"):
        MultiheadAttention.from_torch(torch.nn.Linear(E, E))
    with pytest.raises(TypeError, match=r"from_torch takes batch_first and dtype from module, got batch_first=True, "
                                        r"dtype=torch.float64"):
        MultiheadAttention.from_torch(module, batch_first=True, dtype=torch.float64)
    with pytest.raises(TypeError, match="takes the relative position bias as position_bias="):
        MultiheadAttention.from_torch(module, bias=relbias.T5Bias(H))
    with pytest.raises(TypeError, match="dropout"):
        MultiheadAttention.from_torch(module, dropout=0.0)
    with pytest.raises(ValueError, match="position_bias has num_heads=3"):  # the constructor's own checks
        MultiheadAttention.from_torch(module, position_bias=relbias.T5Bias(3))


def test_a_dtype_mismatch_names_the_key_and_what_it_should_be():
    x = torch.randn(B, 3, E)
    layer = MultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^key is torch.float32 but the layer's parameters are torch.bfloat16, as is "
                                        r"query: query, key and value must all have the parameters' dtype "
                                        r"torch.bfloat16 .*; convert key with .to\(torch.bfloat16\), or the layer "
                                        r"and query with .to\(torch.float32\)"):
        layer(x.bfloat16(), x, None)
    # the layer's parameters agree with the key: the query is the one to convert, and the key is named too
    layer = MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(TypeError, match=r"^query is torch.bfloat16 but the layer's parameters are torch.float32, as "
                                        r"are key and value: .*; convert query with .to\(torch.float32\), or the "
                                        r"layer, key and value with .to\(torch.bfloat16\)"):
        layer(x.bfloat16(), x, x)
    with pytest.raises(TypeError, match=r"^key is torch.float64 and value is torch.float16 but the layer's "
                                        r"parameters are torch.float32, as is query: .*; convert key and value with "
                                        r".to\(torch.float32\), or run under torch.autocast$"):
        layer(x, x.double(), x.half())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast the dtypes may differ
        out, _ = layer(x.bfloat16(), x, x, need_weights=False)
    assert out.dtype == torch.bfloat16
