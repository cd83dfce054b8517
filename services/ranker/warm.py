"""What a ranker serves with once warm, and the one object that carries it across the warm-up."""

from collections.abc import Callable
from dataclasses import dataclass

from relaygr.errors import Unavailable
from relaygr.wire import InputLimits
from services.ranker.engine import RankerEngine
from services.ranker.handoff_grpc import HandoffReceiving

WARMING_UP = "ranker is loading its model and calibrating"


@dataclass(frozen=True, slots=True)
class Warm:
    """A warm ranker's serving parts: its engine, its instance id, the receiving side of
    hand-offs, and how connected it is to etcd (None: standalone, nothing to report)."""

    engine: RankerEngine
    instance_id: str
    handoff: HandoffReceiving
    etcd_connected: Callable[[], bool] | None = None

    @property
    def device(self) -> str:
        return str(self.engine.model.device)

    @property
    def limits(self) -> InputLimits:
        """The model's input limits, which every request is checked against."""
        cfg = self.engine.model.cfg
        return InputLimits(cfg.max_user_features, cfg.max_history_tokens, cfg.max_candidates)


class Warming:
    """The gap between a ranker's servers and its model, crossed by one object.

    The servicer and the metrics are built first, and the gRPC and `/metrics` servers answer
    (health NOT_SERVING) while the model loads and calibrates; the instance id comes from the
    port bound only then. What they serve with (`Warm`) cannot exist when they are built, so
    both are given this instead, and the composition root hands it the `Warm` once, when the
    ranker is ready (`ready`). Until then `warm` is None and `get` raises Unavailable.
    """

    def __init__(self) -> None:
        self._warm: Warm | None = None

    @property
    def warm(self) -> Warm | None:
        return self._warm

    def get(self) -> Warm:
        if self._warm is None:
            raise Unavailable(WARMING_UP)
        return self._warm

    def ready(self, warm: Warm) -> None:
        """The ranker is warm: from now on it serves with `warm` (once only)."""
        if self._warm is not None:
            raise RuntimeError("a ranker warms up once")
        self._warm = warm
