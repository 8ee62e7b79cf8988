"""Context-parallel attention over torch.distributed: a sequence sharded along its length across ranks, with
exact relative offsets across shards (ring, all-to-all and, for local attention, halo strategies), and a rank's
heads of a bias under tensor parallelism. Shards carry global positions; blocks
merge by log-sum-exp. Public names only."""

from .api import context_parallel_attention
from .gather import gather_sequence
from .halo.gather import gather_halo
from .ulysses.heads import HeadSliceBias, slice_heads
from .layout import LAYOUTS, shard, shard_pieces, shard_positions, unshard
from .merge import merge_partials, part_gradients
from .ring.plan import RingStats, block_kind
from .tensor_parallel import TensorParallelHeads, rank_heads
from .validate import STRATEGIES

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "HeadSliceBias",
    "RingStats",
    "TensorParallelHeads",
    "block_kind",
    "context_parallel_attention",
    "gather_halo",
    "gather_sequence",
    "merge_partials",
    "part_gradients",
    "rank_heads",
    "shard",
    "shard_pieces",
    "shard_positions",
    "slice_heads",
    "unshard",
]
