"""RelayGR router: sends a user's PreInfer and Rank to the same ranker."""
