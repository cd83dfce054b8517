"""RelayGR: relay-race serving of generative-recommendation ranking models."""

__version__ = "0.1.0"
