"""Ring attention: the strategy that rotates key and value shards around the ranks (:mod:`.attention`), what it does
with each (query piece, key piece) block (:mod:`.plan`), a block's single-device attention and backward
(:mod:`.blocks`), and the bias-free fused attention of far blocks (:mod:`.fused`)."""
