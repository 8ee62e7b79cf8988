"""DeepSpeed-Ulysses: the strategy that turns sequence shards into head shards by all-to-all (:mod:`.attention`), and
the view of some heads of a bias module it needs (:mod:`.heads`)."""
