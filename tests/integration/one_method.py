"""A real gRPC server on loopback that answers one method, for tests of a client's behaviour."""

import grpc


async def serve_one_method(
    service: str, method: str, handler: grpc.RpcMethodHandler
) -> tuple[grpc.aio.Server, int]:
    """Started on an ephemeral port of 127.0.0.1: the server (the caller stops it) and its port."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
