"""Wires a RankerConfig into a running ranker: model, calibration, KV store, engine, gRPC."""

import asyncio
import json
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from relaygr import service_names
from relaygr.aio import cancel_and_wait
from relaygr.behaviours import UserId
from relaygr.cluster import PlacementRecord, RankerRecord
from relaygr.cost import CallShape, CostModel
from relaygr.cpu_quota import available_cpus
from relaygr.device import select_device
from relaygr.errors import ConfigError, Unavailable
from relaygr.etcd.errors import EtcdRejected
from relaygr.grpc_server import GrpcServer
from relaygr.lifecycle import MeshLink, connect_mesh, serve, start_service_servers, stop_service
from relaygr.metrics import MetricsServer
from relaygr.placement import directory_write
from relaygr.pool import RankerPool
from relaygr.service_main import service_main
from relaygr.telemetry import Telemetry
from relaygr.v1 import ranker_pb2_grpc
from services.ranker.checkpoint import load_checkpoint
from services.ranker.config import ENV_PREFIX, RankerConfig
from services.ranker.cost_fit import Sample, ServedBatch, fit_batch_saving, fit_cost_model
from services.ranker.cost_learner import CostLearner, Republisher
from services.ranker.cost_model import measure, measure_batches, reload_ms_per_mb
from services.ranker.engine import RankerEngine
from services.ranker.fetch import FetchSettings, PeerFetch
from services.ranker.fetch_client import GrpcPeerSource
from services.ranker.handoff import HandoffSender, HandoffSettings, HandoffStats
from services.ranker.handoff_grpc import GrpcHandoffPort, HandoffReceiving
from services.ranker.host_lock import host_lock
from services.ranker.kv_store import KVStore
from services.ranker.membership import Membership
from services.ranker.metrics import RankerMetrics
from services.ranker.model import RankingModel
from services.ranker.model_config import PRESETS, ModelConfig
from services.ranker.observer import EngineObserver, NoopObserver, Work
from services.ranker.peers import successor
from services.ranker.prefix_kv import PrefixKV
from services.ranker.service import RankerServicer
from services.ranker.tracing_observer import (
    engine_observer,
    origin_from_traceparent,
    origin_traceparent,
)
from services.ranker.warm import Warm, Warming

_log = logging.getLogger("services.ranker")
SERVICE = "relaygr-ranker"  # the default OTEL service.name
TICK_S = 1.0  # how often the ranker's core hears that time passed (expiry of pins and copies)


def load_model(cfg: RankerConfig) -> RankingModel:
    """The checkpoint, or the seeded random model of the preset with `model_config`'s keys."""
    device = select_device(cfg.device)
    if cfg.checkpoint is not None:
        return load_checkpoint(cfg.checkpoint, device=device)
    model_config = PRESETS[cfg.model]
    if cfg.model_config is not None:
        try:
            overrides = json.loads(cfg.model_config.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read model_config {cfg.model_config}: {err}") from err
        if not isinstance(overrides, dict):
            raise ConfigError(f"model_config {cfg.model_config} must be a JSON object of fields")
        model_config = ModelConfig.from_dict({**model_config.to_dict(), **overrides})
    return RankingModel(model_config, seed=cfg.model_seed, device=device)


def intra_op_threads(cfg: RankerConfig, cpus: Callable[[], int] = available_cpus) -> int:
    """The torch intra-op threads `cfg` asks for: `threads`, or when 0 this process's CPU quota
    (not the machine's core count: rankers sharing a machine would oversubscribe it)."""
    return cfg.threads or cpus()


def build_engine(
    cfg: RankerConfig,
    model: RankingModel,
    cost_model: CostModel,
    clock: Callable[[], float] = time.monotonic,
    observer: EngineObserver | None = None,
    peer_fetch: PeerFetch | None = None,
) -> RankerEngine:
    """`observer` None: nothing observed; `peer_fetch` None: misses are never fetched."""
    observer = observer or NoopObserver()
    pin = model.device.type != "cpu"

    def to_host(kv: PrefixKV) -> PrefixKV:
        with observer.demoting(kv):
            return kv.to("cpu", pin_memory=pin)

    store = KVStore(cfg.hbm_budget_bytes, cfg.dram_budget_bytes, cfg.dram_ttl_s, clock, to_host)
    return RankerEngine(
        model, store, cost_model, cfg.core_settings(), observer, peer_fetch, clock=clock
    )


def ranker_record(
    instance_id: str, address: str, model: RankingModel, cost: CostModel, cfg: RankerConfig
) -> RankerRecord:
    """What this ranker publishes in the mesh membership."""
    return RankerRecord(
        instance_id=instance_id,
        address=address,
        model_version=model.model_version,
        hbm_budget_bytes=cfg.hbm_budget_bytes,
        dram_budget_bytes=cfg.dram_budget_bytes,
        kv_bytes_per_token=model.cfg.cache_bytes_per_token,
        fixed_ms=cost.fixed_ms,
        per_token_ms=cost.per_token_ms,
        per_pair_ms=cost.per_pair_ms,
        per_candidate_key_ms=cost.per_candidate_key_ms,
        reload_ms_per_mb=cost.reload_ms_per_mb,
        median_abs_rel_error=cost.median_abs_rel_error,
        cost_samples=cost.samples,
        batch_saving_ms=cost.batch_saving_ms,
        batch_samples=cost.batch_samples,
        **cost.cached_terms(),
    )


def calibrate_alone(
    cfg: RankerConfig, model: RankingModel | None
) -> tuple[RankingModel, CostLearner]:
    """Load the model (None: from `cfg`) and calibrate it under the host-wide lock: rankers
    sharing this host's cores time their model one at a time, each with the cores to itself, as
    it will serve (blocks; run in a thread). Loading is inside the lock too: a ranker starting
    torch and building its weights takes the cores another's timings need (measured: a ranker
    timed beside two loading ones published costs 1.4-1.5x too high). The calibrated model,
    batch term included, is the returned learner's first."""
    _log.info("waiting for the host's calibration lock")
    with host_lock(cfg.calibration_lock_dir) as path:
        if model is None:
            model = load_model(cfg)
        _log.info("calibrating (holding %s)", path)
        samples = measure(
            model,
            cfg.calibration_lengths,
            cfg.calibration_candidates,
            cfg.prefill_chunk_tokens,
            cfg.calibration_repeats,
        )
        lengths = cfg.calibration_lengths
        batches = measure_batches(
            model,
            (min(lengths), max(lengths)),
            cfg.calibration_candidates,
            repeats=cfg.calibration_repeats,
        )
        reload = reload_ms_per_mb(model.device)
    calibrated = fit_batch_saving(fit_cost_model(samples, reload), batches)
    return model, CostLearner(samples, calibrated, batches=batches)


class LearnerSink:
    """The engine's compute timings (a `ComputeSink`), as the learner's samples: a single
    call's for the single-call terms, a batched call's for the batch term."""

    def __init__(self, learner: CostLearner) -> None:
        self._learner = learner

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None:
        self._learner.observe(Sample(tokens, candidates, seconds * 1e3, cached_tokens))

    def batch_computed(self, work: Work, shapes: tuple[CallShape, ...], seconds: float) -> None:
        self._learner.observe_batch(ServedBatch(shapes, seconds * 1e3))


async def keep_learning(
    engine: RankerEngine,
    learner: CostLearner,
    cfg: RankerConfig,
    republish: Callable[[CostModel], Awaitable[None]] | None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Refit the cost model every `cost_refit_interval_s` from what was served; the engine and
    Describe use each refit at once, the membership gets it (`republish`; None: standalone)
    when it changed materially (at most once per `cost_republish_interval_s`)."""
    probes = [(n, cfg.calibration_candidates) for n in cfg.calibration_lengths]
    republisher = Republisher(
        learner.model, clock(), probes, min_interval_s=cfg.cost_republish_interval_s
    )
    while True:
        await asyncio.sleep(cfg.cost_refit_interval_s)  # a period, not a synchronisation
        model = await asyncio.to_thread(learner.refit)
        if model is None:
            continue
        engine.cost_model_refitted(model)
        if republish is not None and republisher.offer(model, clock()):
            _log.info("republishing the cost model refitted to served work: %s", model)
            try:
                await republish(model)
            except Unavailable:
                pass  # etcd down: the next change goes
            except EtcdRejected as err:
                # The lease lapsed before its keeper noticed: the membership keeps the newest
                # record, and the keeper's replacement lease puts it. Refitting goes on.
                _log.warning("etcd refused the refitted cost model's republication: %s", err)


async def keep_ticking(engine: RankerEngine, interval_s: float = TICK_S) -> None:
    """Tell the engine time passed every `interval_s`: relays past their window are released
    and stale host copies dropped even while no request comes (the metrics then read them)."""
    while True:
        await asyncio.sleep(interval_s)  # a period, not a synchronisation
        engine.tick()


def peer_fetch(
    cfg: RankerConfig,
    mesh: MeshLink,
    pool: RankerPool,
    instance_id: str,
    model: RankingModel,
    learn: bool,
    metrics: RankerMetrics,
) -> PeerFetch:
    """Fetching missed prefixes from the mesh's peers through `pool`, at the configured transfer
    cost, refitted from the fetches made when `learn` (the compute cost is calibrated here)."""
    cluster = mesh.cluster
    source = GrpcPeerSource(
        pool,
        cluster.view,
        cluster,
        instance_id,
        model.cfg,
        model.device,
        cfg.previous_owners(),
        changed_at=lambda: cluster.members_changed_at,
    )
    settings = FetchSettings(cfg.fetch_timeout_ms / 1e3, cfg.fetch_timeout_floor_ms / 1e3)
    return PeerFetch(
        source, settings, cfg.transfer_prior(), learn=learn, timings=metrics.observe_fetch
    )


@dataclass(slots=True)
class RankerServer:
    """A running ranker (a `RunningService`), built whole once it is warm: its gRPC server, its
    engine and the engine's clock tick, and (with etcd endpoints configured) its membership,
    which holds its registration until drained."""

    server: GrpcServer
    servicer: RankerServicer
    instance_id: str
    engine: RankerEngine
    ticking: "asyncio.Task[None]"  # the engine's clock tick (expiry)
    membership: Membership | None = None  # None: standalone
    metrics_server: MetricsServer | None = None
    learning: "asyncio.Task[None] | None" = None  # refits the cost model from served work
    peer_pool: RankerPool | None = None  # channels to the peers this ranker fetches from
    handoff: HandoffSender | None = None  # None: a drain hands nothing off

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def mesh(self) -> MeshLink | None:
        """The link to the mesh while this ranker is in it (None: standalone, or left)."""
        return None if self.membership is None else self.membership.link

    @property
    def metrics_port(self) -> int | None:
        """The bound `/metrics` port; None when metrics are not served."""
        return None if self.metrics_server is None else self.metrics_server.port

    async def drain(self, grace_s: float) -> None:
        """Stop taking pre-inference and land in-flight prefixes; hand the most valuable held
        prefixes to their next owners (within the hand-off budget, at most `grace_s`) while
        still registered, so Ranks keep hitting here until the receivers hold them; then leave
        the mesh and finish compute.

        Landing and the final compute are not bounded by `grace_s`: queued compute is
        finished, then the server's stop bounds the RPCs still waiting on it.
        """
        await cancel_and_wait(self.learning, self.ticking)
        await self.engine.drain()  # no new PreInfer from here on; Ranks are still served
        mesh = self.mesh
        if self.handoff is not None and mesh is not None:
            await self._hand_off(self.handoff, mesh, grace_s)
        if self.membership is not None:
            await self.membership.leave()
        await self.engine.drain()
        await self.engine.close()

    async def _hand_off(self, handoff: HandoffSender, mesh: MeshLink, grace_s: float) -> None:
        view = mesh.cluster.view()
        try:
            outcomes = await handoff.hand_off(
                view, self.instance_id, self.engine.model.model_version, grace_s
            )
        except Exception:  # never fail a drain over a hand-off: its users recompute
            _log.exception("hand-off failed")
            return
        for o in outcomes:
            _log.info(
                "handed off to %s: %d entries, %d bytes sent; %s",
                o.target.instance_id, o.entries, o.nbytes,
                o.error or f"{o.receipt.admitted} admitted, {o.receipt.refused} refused"
                if o.receipt else "",
            )  # fmt: skip

    async def close(self) -> None:
        await cancel_and_wait(self.ticking)  # stopped without a drain
        if self.metrics_server is not None:
            await self.metrics_server.close()
            self.metrics_server = None
        if self.peer_pool is not None:
            await self.peer_pool.close()
            self.peer_pool = None

    async def stop(self, grace: float = 5.0) -> None:
        await stop_service(self, grace)


async def publish_placements(
    membership: Membership,
    engine: RankerEngine,
    users: list[UserId],
    sender: str,
    ttl_s: float,
) -> None:
    """Record in the directory where handed-off users' prefixes now live, for the users whose
    owner once `sender` has left is not this ranker (`placement.directory_write`): usually
    none, as the sender sends each user to that owner. Nothing once this ranker left the mesh.
    etcd down: Unavailable, for the caller to log; serving goes on."""
    mesh = membership.link
    if mesh is None:
        return
    view, version, me = mesh.cluster.view(), engine.model.model_version, membership.instance_id
    for user in users:
        owner = successor(user, view, sender, version)
        held = mesh.cluster.entry(user, version)
        entry = None if held is None else (held.instance_id, held.expires_at)
        now = time.time()
        if owner is None or not directory_write(me, owner, entry, now, ttl_s):
            continue
        await mesh.cluster.record(PlacementRecord(user, me, now + ttl_s, version), me)


def handoff_receiving(
    cfg: RankerConfig,
    stats: HandoffStats,
    telemetry: Telemetry,
    engine: RankerEngine,
    membership: Membership | None,
) -> HandoffReceiving:
    """The receiving side of hand-offs; the placements of what it takes are published through
    `membership` (None: standalone, nothing to publish)."""
    publish = None
    if membership is not None:
        joined = membership

        def publish(users: list[UserId], sender: str) -> Awaitable[None]:
            return publish_placements(joined, engine, users, sender, cfg.dram_ttl_s)

    return HandoffReceiving(
        stats, cfg.handoff_max_streams, telemetry.tracer, origin_from_traceparent, publish
    )


def handoff_sender(
    cfg: RankerConfig,
    instance_id: str,
    stats: HandoffStats,
    telemetry: Telemetry,
    engine: RankerEngine,
) -> HandoffSender | None:
    """What a drain hands off through (None: hand-off is off)."""
    if not cfg.handoff:
        return None
    port = GrpcHandoffPort(
        instance_id,
        cfg,
        cfg.server_options().message_args(),
        telemetry.client_interceptors(),
        telemetry.tracer,
    )
    return HandoffSender(engine.core, port, HandoffSettings.of(cfg), stats, origin_traceparent)


async def start_ranker(
    cfg: RankerConfig,
    model: RankingModel | None = None,
    cost_model: CostModel | None = None,
    telemetry: Telemetry | None = None,
) -> RankerServer:
    """Start serving: health answers NOT_SERVING at once, SERVING when model and cost are ready.

    `model` and `cost_model` may be given (tests, benchmarks) to skip loading and calibration;
    a given cost model is kept as given. A calibrated one keeps learning from served work.
    Torch's intra-op threads are the process's, not this server's: `_serve` sets them from
    `cfg.threads` before calling this; an embedding process sets its own.
    `telemetry` (one per service; the caller shuts it down) traces and names where `/metrics`
    is served; by default nothing is traced and metrics are served at `cfg.metrics_address`.
    """
    telemetry = telemetry or Telemetry(SERVICE, metrics_address=cfg.metrics_address)
    warming = Warming()  # the servers answer before the model exists: see Warming
    metrics = RankerMetrics(telemetry.registry, warming)
    servicer = RankerServicer(warming, metrics)
    server, metrics_server = await start_service_servers(
        cfg,
        "ranker",
        lambda s: ranker_pb2_grpc.add_RankerServiceServicer_to_server(servicer, s),
        [service_names.RANKER],
        telemetry,
        _log,
    )
    instance_id = cfg.instance_id or f"{socket.gethostname()}:{server.port}"
    learner = None
    if cost_model is None:
        loaded, learner = await asyncio.to_thread(calibrate_alone, cfg, model)
        cost_model = learner.model
        _log.info("calibrated %s: %s", loaded.device, cost_model)
        chunk = cfg.core_settings().background_chunk(cost_model)
        _log.info("background prefill chunk: %d tokens (resized on a refit)", chunk)
    else:
        loaded = model if model is not None else await asyncio.to_thread(load_model, cfg)
    timings = None if learner is None else LearnerSink(learner)
    membership = pool = fetch = None
    if cfg.etcd_endpoints:  # nothing is dialled before the registration below
        mesh = connect_mesh(cfg)
        membership = Membership(mesh, instance_id, cfg.lease_ttl_s)
        if cfg.peer_fetch and cfg.relay_enabled:
            pool = RankerPool(
                cfg.server_options().message_args(), cfg, telemetry.client_interceptors()
            )
            fetch = peer_fetch(cfg, mesh, pool, instance_id, loaded, learner is not None, metrics)
    engine = build_engine(
        cfg, loaded, cost_model, observer=engine_observer(telemetry.tracer, timings),
        peer_fetch=fetch,
    )  # fmt: skip
    ticking = asyncio.create_task(keep_ticking(engine))
    handoff_stats = HandoffStats()  # sent and received, one set of books
    receiving = handoff_receiving(cfg, handoff_stats, telemetry, engine, membership)
    sender = handoff_sender(cfg, instance_id, handoff_stats, telemetry, engine)
    connected = None if membership is None else membership.connected
    warming.ready(Warm(engine, instance_id, receiving, connected))
    await server.set_serving(True)
    address = cfg.advertise_address or f"127.0.0.1:{server.port}"

    def record(cost: CostModel) -> RankerRecord:
        return ranker_record(instance_id, address, loaded, cost, cfg)

    republish = None
    if membership is not None:
        joined = membership
        await joined.join(record(cost_model))

        async def republish(cost: CostModel) -> None:
            await joined.register(record(cost))

    learning = None
    if learner is not None:
        learning = asyncio.create_task(keep_learning(engine, learner, cfg, republish))
    _log.info(
        "ranker %s serving on port %d: model %s on %s, relay %s",
        instance_id,
        server.port,
        loaded.model_version,
        loaded.device,
        "on" if cfg.relay_enabled else "off (bypass)",
    )
    return RankerServer(
        server, servicer, instance_id, engine, ticking, membership, metrics_server, learning,
        pool, sender,
    )  # fmt: skip


async def _serve(cfg: RankerConfig) -> None:
    torch.set_grad_enabled(False)
    # Before the model is built and calibrated: threads torch starts later take this count too,
    # and the calibrated cost model is then the one of the threads that serve.
    threads = intra_op_threads(cfg)
    torch.set_num_threads(threads)
    _log.info(
        "torch intra-op threads: %d (%s)",
        threads,
        "threads option" if cfg.threads else "auto: this process's CPU quota",
    )
    await serve(
        cfg, "ranker", lambda telemetry: start_ranker(cfg, telemetry=telemetry), cfg.instance_id
    )


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        argv,
        prog="relaygr ranker",
        description="Ranker: holds prefix KV caches, scores candidates (relaygr.v1.RankerService).",
        config_cls=RankerConfig,
        env_prefix=ENV_PREFIX,
        serve=_serve,
    )


if __name__ == "__main__":
    sys.exit(main())
