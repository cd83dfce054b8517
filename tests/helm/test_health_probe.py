"""The chart's mTLS exec probe (files/grpc_health_probe.py) against a real gRPC server."""

import asyncio
import os
import shutil
import sys
from pathlib import Path

import grpc

from relaygr.grpc_server import GrpcServer, start_server
from tests.helm.chart import CHART
from tooling.local.certs import Pki, make_pki

PROBE = CHART / "files" / "grpc_health_probe.py"
# The ranker's certificate names every pod of its headless Service with one wildcard.
RANKER_DOMAIN = "t-relaygr-ranker.recsys.svc.cluster.local"


def _secret_dir(pki: Pki, directory: Path, *, cert: Path, key: Path) -> Path:
    """The files as a kubernetes.io/tls Secret mounts them."""
    directory.mkdir()
    shutil.copy(pki.ca_cert, directory / "ca.crt")
    shutil.copy(cert, directory / "tls.crt")
    shutil.copy(key, directory / "tls.key")
    return directory


async def _serving_server(pki: Pki) -> GrpcServer:
    credentials = grpc.ssl_server_credentials(
        [(pki.node_key.read_bytes(), pki.node_cert.read_bytes())],
        root_certificates=pki.ca_cert.read_bytes(),
        require_client_auth=True,
    )
    server = await start_server("127.0.0.1:0", lambda _: None, [], credentials=credentials)
    await server.set_serving(True)
    return server


async def _probe(port: int, tls_dir: Path, server_name: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(PROBE), f"--port={port}", f"--tls-dir={tls_dir}",
        f"--server-name={server_name}", "--timeout-s=5",
        env={**os.environ, "POD_NAME": "t-relaygr-ranker-0"},
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, err.decode()


async def test_probe_reports_serving_then_draining_over_mtls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", hosts=(f"*.{RANKER_DOMAIN}",))
    stranger = make_pki(tmp_path / "stranger", hosts=(f"*.{RANKER_DOMAIN}",))
    tls_dir = _secret_dir(pki, tmp_path / "tls", cert=pki.node_cert, key=pki.node_key)
    # A certificate from another CA: the server must refuse the probe's handshake.
    foreign = _secret_dir(pki, tmp_path / "foreign", cert=stranger.node_cert, key=stranger.node_key)

    server = await _serving_server(pki)
    try:
        name = "${POD_NAME}." + RANKER_DOMAIN  # expanded by the probe, not by the kubelet
        assert await _probe(server.port, tls_dir, name) == (0, "")

        code, err = await _probe(server.port, tls_dir, "router.elsewhere.example")
        assert code == 1 and "health check failed: UNAVAILABLE" in err

        code, err = await _probe(server.port, foreign, name)
        assert code == 1 and "health check failed" in err

        code, err = await _probe(server.port, tmp_path / "missing", name)
        assert code == 1 and "cannot read TLS material" in err

        await server.enter_graceful_shutdown()  # draining: NOT_SERVING from now on
        code, err = await _probe(server.port, tls_dir, name)
        assert (code, err.strip()) == (1, "not serving: NOT_SERVING")
    finally:
        await server.stop(0)
