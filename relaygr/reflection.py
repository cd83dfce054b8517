"""Server reflection under both protocol versions: grpc.reflection.v1 and v1alpha.

grpcio-reflection implements only v1alpha (grpc/grpc#38576). v1 is the same schema under a new
package name, so the v1alpha servicer answers v1 calls as they are: its messages encode to the
bytes a v1 client reads. The v1 file descriptor, which a client asks for to describe the v1
service it found listed, is v1alpha's with the package renamed.
"""

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1_PACKAGE = "grpc.reflection.v1"


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection on `server`, v1 and v1alpha alike, listing `service_names` and both
    reflection services."""
    _add_v1_file(descriptor_pool.Default())
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),)
    )


def _v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file, its package renamed."""
    v1alpha = reflection_pb2.DESCRIPTOR.package
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, _V1_PACKAGE
    proto.ClearField("options")  # code-generation options naming v1alpha's packages

    def renamed(type_name: str) -> str:
        old = f".{v1alpha}."
        return f".{_V1_PACKAGE}.{type_name[len(old) :]}" if type_name.startswith(old) else type_name

    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message field's, not a scalar's
                field.type_name = renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type = renamed(method.input_type)
            method.output_type = renamed(method.output_type)
    return proto


def _add_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """Add the v1 file to `pool` unless it holds one already (another server of this process,
    or a grpcio-reflection that ships v1)."""
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_v1_file_descriptor().SerializeToString())
