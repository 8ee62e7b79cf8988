"""Halo exchange: the strategy for local (sliding-window) attention on contiguous shards, where a rank needs only the
keys its neighbours' windows reach (:mod:`.plan`), exchanged point to point and merged by log-sum-exp
(:mod:`.attention`)."""
