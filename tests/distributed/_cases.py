"""Cases of the multi-process tests: each compares context-parallel attention on every rank with single-process
relbias.attention on the unsharded tensors (outputs and gradients of query, key, value and bias parameters), or
checks a refusal. Shared by the test module (case names) and the worker processes (running them)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import relbias
from relbias.distributed import RingStats, context_parallel_attention, shard

B, H, D = 2, 4, 8
TOL = 1e-5


def make_bias(family: str) -> relbias.RelativeBias | None:
    """The bias of a family at test size (far distances small enough that 64-token sequences have far blocks)."""
    if family == "t5_causal":
        return relbias.T5Bias(H, num_buckets=8, max_distance=16, bidirectional=False, init_std=0.5)
    if family == "t5":
        return relbias.T5Bias(H, num_buckets=8, max_distance=16, init_std=0.5)
    if family == "offset":  # seed convention: the bias (and its far constant) is scaled
        return relbias.PerOffsetBias(max_len=16, num_heads=H, out_of_range="clip", init_std=0.5)
    if family == "offset_shared_causal":
        return relbias.PerOffsetBias(max_len=12, bidirectional=False, out_of_range="clip", init_std=0.5)
    if family == "alibi":
        return relbias.ALiBiBias(H, bidirectional=False)
    if family == "fire":
        return relbias.FIREBias(H, hidden_width=8)
    if family == "none":
        return None
    raise ValueError(family)


#: family -> is_causal
FAMILIES = {
    "t5_causal": True, "t5": False, "offset": False, "offset_shared_causal": True, "alibi": True, "none": False,
}


@dataclass(frozen=True)
class Case:
    family: str
    is_causal: bool
    layout: str
    strategy: str
    padding: bool
    seq_len: int = 64
    dtype: str = "float32"
    kv_chunks: int | None = None  # None: the default (whole shards at these lengths)
    window: tuple[int | None, int | None] | None = None  # local attention (left, right)
    dropout_p: float = 0.0  # attention dropout: the same generator state as the single process's

    @property
    def name(self) -> str:
        pad = "-pad" if self.padding else ""
        f64 = "-float64" if self.dtype == "float64" else ""
        chunks = "" if self.kv_chunks is None else f"-chunks{self.kv_chunks}"
        window = "" if self.window is None else f"-window{self.window[0]}_{self.window[1]}"
        dropout = f"-dropout{self.dropout_p}" if self.dropout_p else ""
        return (f"{self.family}-{'causal' if self.is_causal else 'bidir'}-{self.layout}-{self.strategy}{pad}{f64}"
                f"{chunks}{window}{dropout}")

    @property
    def tolerance(self) -> float:
        """Absolute and relative bound: 1e-5 in float32; 1e-10 in float64, where only rounding differs."""
        return TOL if self.dtype == "float32" else 1e-10


def comparison_cases() -> list[Case]:
    cases = []
    for family, causal in FAMILIES.items():
        for layout in ("contiguous", "zigzag"):
            for strategy in ("ring", "ulysses"):
                padding = (layout == "contiguous") == (strategy == "ring")  # padded: contiguous ring, zigzag ulysses
                cases.append(Case(family, causal, layout, strategy, padding))
    cases.append(Case("fire", True, "zigzag", "ring", True, seq_len=32))
    cases.append(Case("fire", True, "contiguous", "ulysses", False, seq_len=32))
    cases.append(Case("t5", True, "zigzag", "ring", False))  # bidirectional table, causal attention
    # float64: the sharded computation is exact, so it agrees to rounding (far tighter than float32's bound)
    cases.append(Case("t5", False, "zigzag", "ring", True, dtype="float64"))
    cases.append(Case("t5_causal", True, "contiguous", "ring", True, dtype="float64"))
    cases.append(Case("offset", False, "zigzag", "ulysses", True, dtype="float64"))
    # keys and values travelling in chunks (one rotation each): 64 tokens give P = 4 chunks of 4 tokens
    cases.append(Case("t5_causal", True, "zigzag", "ring", True, kv_chunks=4))
    cases.append(Case("t5", False, "contiguous", "ring", True, kv_chunks=4))
    cases.append(Case("offset_shared_causal", True, "contiguous", "ring", False, kv_chunks=2))
    cases.append(Case("fire", True, "zigzag", "ring", False, seq_len=32, kv_chunks=2))
    cases.append(Case("t5", False, "zigzag", "ring", False, dtype="float64", kv_chunks=4))
    # local attention: blocks wholly outside the window are skipped, blocks it cuts run with it
    cases.append(Case("t5_causal", True, "contiguous", "ring", True, window=(9, 0)))
    cases.append(Case("t5", False, "zigzag", "ring", False, window=(6, 3)))
    cases.append(Case("offset", False, "contiguous", "ring", True, window=(5, 5)))
    cases.append(Case("alibi", True, "zigzag", "ulysses", True, window=(12, 0)))
    cases.append(Case("t5_causal", True, "contiguous", "ring", False, dtype="float64", kv_chunks=4, window=(20, 0)))
    # the halo: only the keys the windows reach travel, from one neighbour or (windows longer than a shard) several
    cases += HALO_CASES
    cases.append(Case("t5_causal", True, "contiguous", "auto", True, window=(9, 0)))  # picks the halo
    cases.append(Case("t5", False, "contiguous", "auto", False, window=(None, 3)))  # unbounded: picks the ring
    return cases


#: Halo cases; the first two differ only in the sequence length (their traffic must not).
HALO_CASES = [
    Case("t5_causal", True, "contiguous", "halo", True, window=(9, 0)),
    Case("t5_causal", True, "contiguous", "halo", True, seq_len=128, window=(9, 0)),
    Case("t5", False, "contiguous", "halo", False, window=(6, 3)),
    Case("offset", False, "contiguous", "halo", True, window=(5, 5)),
    Case("alibi", True, "contiguous", "halo", False, window=(12, 0)),
    Case("fire", True, "contiguous", "halo", True, seq_len=32, window=(7, 0)),
    Case("none", False, "contiguous", "halo", True, window=(3, 17)),
    Case("offset_shared_causal", True, "contiguous", "halo", False, window=(0, 4)),  # causal: no halo at all
    # longer than a shard (16 tokens on 4 ranks, 32 on 2): parts from two or three ranks before (and after)
    Case("t5_causal", True, "contiguous", "halo", True, dtype="float64", window=(40, 0)),
    Case("offset", False, "contiguous", "halo", False, dtype="float64", window=(20, 37)),
    Case("t5", False, "contiguous", "halo", True, seq_len=128, window=(70, 1)),
    # dropout: every block draws, at its absolute positions, the bits one process draws (rank 0's seed)
    Case("t5_causal", True, "contiguous", "halo", True, dtype="float64", window=(20, 0), dropout_p=0.3),
    Case("fire", False, "contiguous", "halo", False, dtype="float64", seq_len=32, window=(5, 9), dropout_p=0.2),
    Case("offset", False, "contiguous", "halo", True, window=(40, 3), dropout_p=0.5),
]


#: Cases that 4 processes also run as two independent groups of 2 (``group=``, ranks {0, 1} and {2, 3}).
SUBGROUP_CASES = [Case("t5", False, "zigzag", "ring", True), Case("offset", False, "contiguous", "ulysses", True)]

#: refusal name -> (exception type name, substring of the message)
REFUSALS = {
    "zigzag_odd_local_length": ("ValueError", "must be even"),
    "ulysses_heads_not_divisible": ("ValueError", "divisible"),
    "unknown_layout": ("ValueError", "layout must be one of"),
    "unknown_strategy": ("ValueError", "strategy must be one of"),
    "halo_zigzag": ("ValueError", "strategy 'halo' exchanges the keys next to each contiguous shard"),
    "halo_unbounded_window": ("ValueError", "strategy 'halo' needs a window bounded on both sides"),
    "halo_double_backward": ("RuntimeError", "strategy 'halo') has no double backward"),
    "dropout_on_the_ring": ("ValueError", "runs on strategy 'halo'"),
    "dropout_p_differs_across_ranks": ("ValueError", "dropout_p: [0.1, 0.2"),
    "mask_wrong_shape": ("ValueError", "key padding mask"),
    "tensor_bias": ("TypeError", "RelativeBias module"),
    "offset_table_too_short": ("ValueError", "has no parameter"),
    "causal_only_bias_bidirectional_call": ("ValueError", "is_causal=True"),
    "ring_double_backward": ("RuntimeError", "strategy 'ring') has no double backward"),
    "ulysses_double_backward": ("RuntimeError", "strategy 'ulysses') has no double backward"),
    "kv_chunks_odd_with_zigzag": ("ValueError", "kv_chunks=3 cannot split"),
    "kv_chunks_not_dividing": ("ValueError", "kv_chunks=8 cannot split"),
    "kv_chunks_zero": ("ValueError", "kv_chunks must be >= 1, got 0"),
    "kv_chunks_not_int": ("TypeError", "kv_chunks must be an int"),
    # settings that differ between ranks: one gather compares them, and every rank raises (no abort, no hang)
    "kv_chunks_differ_across_ranks": ("ValueError", "different shapes or settings to context-parallel attention"),
    "mask_on_some_ranks": ("ValueError", "mask (batch, 0: none): [1, 0"),
    "scale_differs_across_ranks": ("ValueError", "scale: [0.5, 0.25"),
    "convention_differs_across_ranks": ("ValueError", "convention: ['seed', 'additive'"),
    "dtype_differs_across_ranks": ("ValueError", "dtype: ['torch.float32', 'torch.float64'"),
    "window_negative": ("ValueError", "window left must be >= 0"),
    "window_differs_across_ranks": ("ValueError", "window left (-1: none): [4, 5"),
    # inputs refused on one rank only: that rank raises its error, the others one naming it (none waits for it)
    "mask_wrong_shape_on_last_rank": ("ValueError", "key padding mask"),
    "tensor_bias_on_rank_0": ("TypeError", "RelativeBias module"),
}
#: one-rank refusals -> the rank refusing; the other ranks' messages name it
ONE_RANK_REFUSALS = {"mask_wrong_shape_on_last_rank": -1, "tensor_bias_on_rank_0": 0}


def _key_padding(seq_len: int) -> torch.Tensor:
    """(B, 1, 1, L) bool: batch 0 keeps everything; batch 1 drops its first 3 and last 9 keys and two in between
    (under a causal mask, its first 3 queries see no key)."""
    keep = torch.ones(B, 1, 1, seq_len, dtype=torch.bool)
    keep[1, ..., :3] = False
    keep[1, ..., seq_len - 9 :] = False
    keep[1, ..., seq_len // 2] = False
    keep[1, ..., seq_len // 2 + 5] = False
    return keep


def run_case(case: Case, rank: int, world_size: int, group=None) -> dict:
    """Run one comparison on this rank (``rank`` and ``world_size`` in ``group``, default the whole world): how far each result is beyond ``tol·(1 + |ref|)`` (0 when within) and the
    ring's stats."""
    torch.manual_seed(1234)
    length = case.seq_len
    dtype = getattr(torch, case.dtype)
    q, k, v, g = (torch.randn(B, H, length, D, dtype=dtype) for _ in range(4))
    # Scores of order 1. Merging by log-sum-exp holds each block's weights to |lse| x 2^-24 in float32 (as any
    # flash-style kernel): with T5's unscaled scores on unit-variance q and k (|lse| ~ 15, |dq| ~ 7) that alone
    # reaches 1e-5 in dq. The float64 cases show that the sharded computation itself is exact.
    q, k = q * 0.5, k * 0.5
    bias = make_bias(case.family)
    bias = bias if bias is None else bias.to(dtype)
    ref_bias = copy.deepcopy(bias)
    mask = _key_padding(length) if case.padding else None

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dropout = {}
    if case.dropout_p:  # one generator state for the single process and rank 0 (the others' are unused)
        dropout = dict(dropout_p=case.dropout_p, generator=torch.Generator().manual_seed(99 + 7 * (rank != 0)))
    ref = relbias.attention(*leaves, bias=ref_bias, mask=mask, is_causal=case.is_causal, window=case.window,
                            **{**dropout, "generator": torch.Generator().manual_seed(99)} if dropout else {})
    (ref * g).sum().backward()

    def local(t):
        return shard(t, world_size, rank, layout=case.layout)

    mine = [local(t).requires_grad_(True) for t in (q, k, v)]
    stats = RingStats()
    out = context_parallel_attention(
        *mine, bias=bias, mask=None if mask is None else shard(mask, world_size, rank, layout=case.layout, dim=-1),
        is_causal=case.is_causal, layout=case.layout, strategy=case.strategy, stats=stats, group=group,
        kv_chunks=case.kv_chunks, window=case.window, **dropout,
    )
    (out * local(g)).sum().backward()
    with torch.no_grad():  # inference runs without the autograd Function
        out_no_grad = context_parallel_attention(
            *mine, bias=bias, mask=None if mask is None else shard(mask, world_size, rank, layout=case.layout, dim=-1),
            is_causal=case.is_causal, layout=case.layout, strategy=case.strategy, group=group,
            kv_chunks=case.kv_chunks, window=case.window,
            **{**dropout, "generator": torch.Generator().manual_seed(99)} if dropout else {},
        )

    pairs = {"out": (out, local(ref)), "out_no_grad": (out_no_grad, local(ref))}
    for name, m, r in zip(("dq", "dk", "dv"), mine, leaves):
        pairs[name] = (m.grad, local(r.grad))
    if bias is not None:
        for (name, p), rp in zip(bias.named_parameters(), ref_bias.parameters()):
            pairs[f"d_{name}"] = (p.grad, rp.grad)
    errors = {}
    for name, (got, want) in pairs.items():
        if got is None or want is None:
            errors[name] = float("inf") if (got is None) != (want is None) else 0.0
            continue
        excess = ((got - want).abs() - case.tolerance * (1 + want.abs())).max().item()
        errors[name] = max(excess, 0.0)
    traffic = [stats.sent_bytes, stats.received_bytes, stats.backward_sent_bytes, stats.backward_received_bytes]
    return {"errors": errors, "stats": [stats.blocks, stats.skipped, stats.bias_free, stats.biased], "traffic": traffic}


def run_refusal(name: str, rank: int, world_size: int) -> str | None:
    """Make the refused call; return ``"TypeName: message"`` of what it raised, or None if it did not raise."""
    torch.manual_seed(0)
    length = 2 * world_size * 2
    q = torch.randn(1, H, length // world_size, D)
    kwargs: dict = {}
    if name == "zigzag_odd_local_length":
        q = torch.randn(1, H, 3, D)
        kwargs["layout"] = "zigzag"
    elif name == "ulysses_heads_not_divisible":
        q = torch.randn(1, world_size + 1, 4, D)
        kwargs["strategy"] = "ulysses"
    elif name == "unknown_layout":
        kwargs["layout"] = "striped"
    elif name == "unknown_strategy":
        kwargs["strategy"] = "tree"
    elif name == "halo_zigzag":
        kwargs.update(strategy="halo", layout="zigzag", window=(2, 0), is_causal=True)
    elif name == "halo_unbounded_window":
        kwargs.update(strategy="halo", window=(2, None))
    elif name == "dropout_on_the_ring":
        kwargs.update(strategy="ring", dropout_p=0.1)
    elif name == "dropout_p_differs_across_ranks":
        kwargs.update(strategy="halo", window=(2, 0), is_causal=True, dropout_p=0.1 if rank == 0 else 0.2)
    elif name == "mask_wrong_shape":
        kwargs["mask"] = torch.ones(1, 1, 1, q.shape[2] + 1, dtype=torch.bool)
    elif name == "tensor_bias":
        kwargs["bias"] = torch.zeros(1, H, q.shape[2], q.shape[2])
    elif name == "offset_table_too_short":
        kwargs["bias"] = relbias.PerOffsetBias(max_len=q.shape[2])  # local length fits, the global length does not
    elif name == "causal_only_bias_bidirectional_call":
        kwargs["bias"] = relbias.ALiBiBias(H, bidirectional=False)
    elif name == "kv_chunks_odd_with_zigzag":
        kwargs.update(layout="zigzag", kv_chunks=3)  # 2 pieces: 1 or an even number of chunks
    elif name == "kv_chunks_not_dividing":
        kwargs["kv_chunks"] = 8  # local length 4
    elif name == "kv_chunks_zero":
        kwargs["kv_chunks"] = 0
    elif name == "kv_chunks_not_int":
        kwargs["kv_chunks"] = 2.0
    elif name == "kv_chunks_differ_across_ranks":
        kwargs["kv_chunks"] = 1 if rank == 0 else 2
    elif name == "mask_on_some_ranks":
        kwargs["mask"] = torch.ones(1, 1, 1, q.shape[2], dtype=torch.bool) if rank == 0 else None
    elif name == "scale_differs_across_ranks":
        kwargs["scale"] = 0.5 if rank == 0 else 0.25
    elif name == "convention_differs_across_ranks":
        kwargs.update(scale=0.5, convention="seed" if rank == 0 else "additive")
    elif name == "dtype_differs_across_ranks":
        q = q if rank == 0 else q.double()
    elif name == "mask_wrong_shape_on_last_rank":
        kwargs["mask"] = torch.ones(1, 1, 1, q.shape[2] + (rank == world_size - 1), dtype=torch.bool)
    elif name == "tensor_bias_on_rank_0":
        kwargs["bias"] = torch.zeros(1, H, q.shape[2], q.shape[2]) if rank == 0 else relbias.T5Bias(H)
    elif name == "window_negative":
        kwargs["window"] = (-1, 0)
    elif name == "window_differs_across_ranks":
        kwargs["window"] = (4 if rank == 0 else 5, 0)
    elif name.endswith("_double_backward"):  # a gradient penalty: refused on every rank before communicating
        q = q.requires_grad_(True)
        kwargs.update(bias=relbias.T5Bias(H), strategy=name.split("_")[0])
        if kwargs["strategy"] == "halo":
            kwargs["window"] = (3, 2)
    try:
        out = context_parallel_attention(q, q, q, **kwargs)
        if name.endswith("_double_backward"):
            torch.autograd.grad(out.sum(), q, create_graph=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks type and message
        return f"{type(exc).__name__}: {exc}"
    return None


def run_in_place(rank: int, world_size: int) -> dict:
    """Each strategy's output changed in place before backward (as ``F.dropout(out, inplace=True)`` does), float32
    and float64: ``{strategy-dtype: None, or the error}``."""
    got = {}
    for strategy in ("ring", "halo", "ulysses"):
        for dtype in (torch.float32, torch.float64):
            torch.manual_seed(0)
            q = torch.randn(1, H, 8, D, dtype=dtype, requires_grad=True)
            try:
                out = context_parallel_attention(q, q, q, strategy=strategy, window=(3, 3), bias=relbias.T5Bias(H).to(dtype))
                out.mul_(2.0)
                out.sum().backward()
                got[f"{strategy}-{dtype}"] = None if q.grad is not None else "no gradient"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                got[f"{strategy}-{dtype}"] = f"{type(exc).__name__}: {exc}"
    return got


def run_gather_halo(rank: int, world_size: int) -> dict:
    """``gather_halo`` against slicing the full tensor, and its gradient: position j of the sequence, held by one
    rank and lent to the ranks whose halo covers it, gets the sum of every rank's gradient of it. ``{reach: error}``."""
    from relbias.distributed import gather_halo

    got = {}
    length = 8 * world_size
    for reach in ((3, 2), (0, 5), (11, 0), (20, 40)):
        torch.manual_seed(3)
        x_full, g_full = torch.randn(B, H, length, D, dtype=torch.float64), torch.randn(B, H, length, D, dtype=torch.float64)
        x = shard(x_full, world_size, rank).requires_grad_(True)
        ext, first = gather_halo(x, reach)
        error = (ext - x_full[:, :, first: first + ext.shape[2]]).abs().max().item()
        (ext * g_full[:, :, first: first + ext.shape[2]]).sum().backward()
        n = length // world_size
        covers = torch.zeros(length, dtype=torch.float64)  # how many ranks' extended shards hold each position
        for r in range(world_size):
            covers[max(0, r * n - reach[0]): min(length, (r + 1) * n + reach[1])] += 1
        want = shard(g_full * covers[:, None], world_size, rank)
        got[str(reach)] = max(error, (x.grad - want).abs().max().item())
    return got
