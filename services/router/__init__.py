"""RelayGR router: affinity-aware placement of PreInfer and Rank (arrives with the router issue)."""
