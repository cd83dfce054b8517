"""The four systems a relay comparison runs on the same traffic, and how a local mesh runs each.

- no cache: rankers bypass every cache (every Rank a full inference): a mesh of its own;
- cache only: nothing pre-inferred (trigger `off`); rankers keep the prefixes their Ranks
  computed, so a return visit can hit: the strongest system without the relay;
- relay all: the trigger relays every retrieval event;
- relay sequence-aware: the trigger relays the at-risk events within its footprint and load
  budgets.

The last three share one mesh and differ only in the trigger's live-config mode.
"""

from dataclasses import dataclass

# A ranker flag: relay and caches off, every Rank a full inference (outcome `bypass`).
BYPASS_FLAG = "--no-relay-enabled"


@dataclass(frozen=True, slots=True)
class System:
    label: str
    trigger_mode: str  # the trigger's live-config mode (tooling.local.drive.set_trigger_mode)
    bypass: bool  # rankers run with BYPASS_FLAG

    def ranker_flags(self) -> tuple[str, ...]:
        """What a ranker of this system's mesh adds to its command line."""
        return (BYPASS_FLAG,) if self.bypass else ()


NO_CACHE = System("no cache", "off", bypass=True)
CACHE_ONLY = System("cache only", "off", bypass=False)
RELAY_ALL = System("relay all", "all", bypass=False)
RELAY_AWARE = System("relay sequence-aware", "sequence-aware", bypass=False)
SYSTEMS = (NO_CACHE, CACHE_ONLY, RELAY_ALL, RELAY_AWARE)
BY_LABEL = {system.label: system for system in SYSTEMS}
