"""Fleet changes during a simulation: `T:kill:RANKER`, `T:drain:RANKER`, `T:start`,
`T:scale-out:N` (N rankers join), `T:rolling-restart:S` (each ranker in turn, S seconds apart,
is replaced: a new one joins, then the old one drains). T is seconds from the start."""

from dataclasses import dataclass

from relaygr.errors import InvalidInput
from tooling.sim.fleet import Fleet

KINDS = ("kill", "drain", "start", "scale-out", "rolling-restart")


@dataclass(frozen=True, slots=True)
class FleetEvent:
    at: float
    kind: str
    arg: str = ""

    @classmethod
    def parse(cls, text: str) -> "FleetEvent":
        """`T:KIND[:ARG]`; InvalidInput says what is wrong."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[1] not in KINDS:
            raise InvalidInput(
                f"fleet event {text!r}: expected T:KIND[:ARG] with KIND one of {', '.join(KINDS)}"
            )
        try:
            at = float(parts[0])
        except ValueError:
            bad = f"fleet event {text!r}: T must be seconds, got {parts[0]!r}"
            raise InvalidInput(bad) from None
        if not at >= 0:
            raise InvalidInput(f"fleet event {text!r}: T must be >= 0")
        kind, arg = parts[1], parts[2] if len(parts) == 3 else ""
        needs = {"kill": "a ranker id", "drain": "a ranker id", "scale-out": "a count",
                 "rolling-restart": "seconds between rankers"}  # fmt: skip
        if kind in needs and not arg:
            raise InvalidInput(f"fleet event {text!r}: {kind} needs {needs[kind]}")
        if kind == "scale-out" and not (arg.isdigit() and int(arg) > 0):
            raise InvalidInput(f"fleet event {text!r}: scale-out needs a positive count")
        if kind == "rolling-restart":
            try:
                ok = float(arg) > 0
            except ValueError:
                ok = False
            if not ok:
                raise InvalidInput(f"fleet event {text!r}: rolling-restart needs seconds > 0")
        return cls(at, kind, arg)


def schedule(fleet: Fleet, event: FleetEvent) -> None:
    """Put `event` on the fleet's clock."""
    loop = fleet.loop

    def apply() -> None:
        if event.kind == "kill":
            _known(fleet, event.arg)
            fleet.kill(event.arg)
        elif event.kind == "drain":
            _known(fleet, event.arg)
            fleet.drain(event.arg)
        elif event.kind == "start":
            fleet.add_ranker()
        elif event.kind == "scale-out":
            for _ in range(int(event.arg)):
                fleet.add_ranker()
        else:
            step = float(event.arg)
            for i, old in enumerate(fleet.live()):
                loop.after(i * step, _replace, fleet, old)

    loop.at(event.at, apply)


def _replace(fleet: Fleet, old: str) -> None:
    fleet.add_ranker()
    fleet.drain(old)


def _known(fleet: Fleet, instance: str) -> None:
    if instance not in fleet.rankers:
        raise InvalidInput(f"fleet event names {instance!r}; rankers are {sorted(fleet.rankers)}")
