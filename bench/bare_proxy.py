"""The least a Python gRPC hop can do: forward every unary call's bytes to one target.

The router benchmark's floor: no placement, no views, no interceptor, one pooled channel.

    python bench/bare_proxy.py TARGET_HOST:PORT     # prints "listening on port N"
"""

import asyncio
import sys

import grpc


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        call = self._channel.unary_unary(details.method)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await call(request, timeout=context.time_remaining())

        return grpc.unary_unary_rpc_method_handler(forward)


async def serve(target: str) -> None:
    channel = grpc.aio.insecure_channel(target)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_Forward(channel),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on port {port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
