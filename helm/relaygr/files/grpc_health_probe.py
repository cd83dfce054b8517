"""grpc.health.v1 check over mutual TLS, for exec probes (Kubernetes' grpc probe is plaintext).

Exit 0 when the server at 127.0.0.1:PORT answers SERVING for the service "" within the timeout;
1 otherwise, with the reason on stderr. The pod's own certificate authenticates the probe, and
the server's certificate is verified against ca.crt for the name given by --server-name (in
which $VAR is expanded from the environment: exec probes do not expand $(VAR)).
"""

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(port: int, tls_dir: Path, server_name: str, timeout_s: float) -> str | None:
    """None when SERVING, else what went wrong."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(tls_dir / "ca.crt").read_bytes(),
        private_key=(tls_dir / "tls.key").read_bytes(),
        certificate_chain=(tls_dir / "tls.crt").read_bytes(),
    )
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as err:
            return f"health check failed: {err.code().name}: {err.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"not serving: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--tls-dir", type=Path, required=True, help="holds tls.crt, tls.key, ca.crt"
    )
    parser.add_argument("--server-name", default="", help="name the server certificate must carry")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        problem = check(
            args.port, args.tls_dir, os.path.expandvars(args.server_name), args.timeout_s
        )
    except OSError as err:
        problem = f"cannot read TLS material: {err}"
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
