"""The sinusoidal and rotary baselines against their papers' formulas, computed independently here."""

from __future__ import annotations

import math

import pytest
import torch

from relbias.experiments import ByteLM, ByteLMConfig
from relbias.experiments.positional import RotaryByteLM, SinusoidalByteLM, apply_rotary, sinusoidal_positions

TINY = dict(max_len=8, embed_dim=16, num_heads=2, num_layers=1)


def test_sinusoidal_positions_follow_vaswani_section_3_5():
    length, dim = 50, 6
    pe = sinusoidal_positions(length, dim, dtype=torch.float64)
    assert pe.shape == (length, dim)
    for pos in (0, 1, 7, 49):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-12)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-12)
    assert pe[3, 0].item() == pytest.approx(math.sin(3.0)) and pe[3, 1].item() == pytest.approx(math.cos(3.0))
    with pytest.raises(ValueError, match="even width >= 2, got 5"):
        sinusoidal_positions(4, 5)


def _rotation(m: int, d: int) -> torch.Tensor:
    """RoFormer eq. 15: block-diagonal R_m with 2x2 blocks [[cos m t_i, -sin m t_i], [sin m t_i, cos m t_i]]."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        t = m * 10000 ** (-2 * i / d)
        r[2 * i, 2 * i], r[2 * i, 2 * i + 1] = math.cos(t), -math.sin(t)
        r[2 * i + 1, 2 * i], r[2 * i + 1, 2 * i + 1] = math.sin(t), math.cos(t)
    return r


def test_rotary_equals_the_rotation_matrix_of_roformer_eq_15():
    torch.manual_seed(0)
    d, length = 8, 12
    x = torch.randn(2, 3, length, d, dtype=torch.float64)
    out = apply_rotary(x)
    for m in (0, 1, 5, 11):
        assert torch.allclose(out[:, :, m], x[:, :, m] @ _rotation(m, d).T, atol=1e-12)
    # The score of rotated q at m and k at n depends on m - n only (§3.4.2, eq. 16).
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    rotated_q, rotated_k = apply_rotary(q.expand(length, d)), apply_rotary(k.expand(length, d))
    assert rotated_q[9] @ rotated_k[4] == pytest.approx((rotated_q[6] @ rotated_k[1]).item(), abs=1e-12)
    with pytest.raises(ValueError, match=r"even head_dim\), got shape \(4, 3\)"):
        apply_rotary(torch.zeros(4, 3))


def test_baselines_start_from_the_nope_models_weights_and_refuse_caches():
    torch.manual_seed(1)
    nope = ByteLM(ByteLMConfig(position="none", **TINY))
    for cls in (SinusoidalByteLM, RotaryByteLM):
        torch.manual_seed(1)
        model = cls(ByteLMConfig(position="none", **TINY))
        assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in nope.named_parameters()]
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), nope.parameters()))
        with pytest.raises(ValueError, match="scores whole windows from position 0"):
            model(torch.zeros(1, 4, dtype=torch.long), cache=model.make_cache(1))
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    sinusoidal = SinusoidalByteLM(ByteLMConfig(position="none", **TINY))
    expected = sinusoidal.embed.weight[tokens[0]] * 4.0 + sinusoidal_positions(5, 16)  # sqrt(16) = 4
    assert torch.allclose(sinusoidal.embed(tokens)[0], expected)


def test_rotary_model_attention_equals_an_explicit_computation():
    torch.manual_seed(2)
    model = RotaryByteLM(ByteLMConfig(position="none", **TINY))
    attn = model.blocks[0].attn
    x = torch.randn(1, 6, 16)
    out, _ = attn(x, x, x)
    q = attn.q_proj(x).view(1, 6, 2, 8).transpose(1, 2).double()
    k = attn.k_proj(x).view(1, 6, 2, 8).transpose(1, 2).double()
    v = attn.v_proj(x).view(1, 6, 2, 8).transpose(1, 2).double()
    heads = torch.zeros(1, 2, 6, 8, dtype=torch.float64)
    for m in range(6):
        scores = torch.stack([(q[0, :, m] @ _rotation(m, 8).T * (k[0, :, n] @ _rotation(n, 8).T)).sum(-1)
                              for n in range(m + 1)], dim=-1) / math.sqrt(8)  # (H, m + 1) causal
        heads[0, :, m] = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v[0, :, : m + 1])
    expected = attn.out_proj(heads.transpose(1, 2).reshape(1, 6, 16).float())
    assert torch.allclose(out, expected, atol=1e-5)
