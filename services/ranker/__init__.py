"""RelayGR ranker: the HSTU ranking model, its prefix KV cache and (later) the KV tiers."""
