"""One read of a process's /metrics page: its samples, parsed by prometheus_client's parser.

Benchmarks count what the services did from these; tests read them to explain a failure.
"""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(url: str, timeout_s: float = 10.0) -> list[Sample]:
    """Every sample `url` (a /metrics address) serves now."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
