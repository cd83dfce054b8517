"""RelayGR trigger: decides at retrieval time which requests to relay, and sends them."""
