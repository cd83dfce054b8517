"""The RelayGR services (trigger, router, ranker); each imports the shared base only."""
