"""The generated relaygr.v1 stubs import, and every message round-trips through the wire."""

import importlib

import pytest
from google.protobuf import descriptor, message

from relaygr import service_names

MODULES = ["common", "ranker", "router", "trigger"]
SERVICES = {
    "ranker": ("RankerService", ["PreInfer", "Rank", "Describe", "Handoff", "Fetch"]),
    "router": ("RouterService", ["PreInfer", "Rank"]),
    "trigger": ("TriggerService", ["OnRetrieval"]),
}
FD = descriptor.FieldDescriptor


def _messages() -> list[type[message.Message]]:
    found = []
    for name in MODULES:
        module = importlib.import_module(f"relaygr.v1.{name}_pb2")
        for msg in module.DESCRIPTOR.message_types_by_name.values():
            found.append(getattr(module, msg.name))
    return found


def _fill(msg: message.Message, depth: int = 0) -> None:
    """Set every field to a non-default value (lists of two for repeated fields)."""
    for number, field in enumerate(msg.DESCRIPTOR.fields, start=1):
        repeated = field.is_repeated
        if field.type == FD.TYPE_MESSAGE:
            if depth > 3:
                continue
            if repeated:
                for _ in range(2):
                    _fill(getattr(msg, field.name).add(), depth + 1)
            else:
                _fill(getattr(msg, field.name), depth + 1)
            continue
        if field.type == FD.TYPE_ENUM:
            value: object = field.enum_type.values[-1].number
        elif field.type == FD.TYPE_STRING:
            value = f"{field.name}-{number}"
        elif field.type == FD.TYPE_BYTES:
            value = f"{field.name}-{number}".encode()
        elif field.type == FD.TYPE_BOOL:
            value = True
        elif field.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            value = 0.5 + number
        elif field.type in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
            value = -(2**40) - number
        elif field.type in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
            value = -number
        else:
            value = 2**31 + number if field.type in (FD.TYPE_UINT64, FD.TYPE_FIXED64) else number
        if repeated:
            getattr(msg, field.name).extend([value, value])
        else:
            setattr(msg, field.name, value)


@pytest.mark.parametrize("cls", _messages(), ids=lambda c: c.DESCRIPTOR.full_name)
def test_every_message_round_trips(cls: type[message.Message]) -> None:
    original = cls()
    _fill(original)
    assert original.ByteSize() > 0 or not cls.DESCRIPTOR.fields
    decoded = cls.FromString(original.SerializeToString())
    assert decoded == original
    assert cls.DESCRIPTOR.full_name.startswith("relaygr.v1.")


def test_behaviour_arrays_are_packed_columns() -> None:
    from relaygr.v1 import common_pb2

    behaviours = common_pb2.Behaviours.DESCRIPTOR
    for name in ("item_ids", "actions", "timestamps"):
        field = behaviours.fields_by_name[name]
        assert field.is_repeated and field.is_packed, name


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_services_and_stubs_exist(module: str) -> None:
    service, methods = SERVICES[module]
    pb2 = importlib.import_module(f"relaygr.v1.{module}_pb2")
    grpc_module = importlib.import_module(f"relaygr.v1.{module}_pb2_grpc")
    assert sorted(m.name for m in pb2.DESCRIPTOR.services_by_name[service].methods) == sorted(
        methods
    )
    assert hasattr(grpc_module, f"{service}Stub")
    assert hasattr(grpc_module, f"{service}Servicer")
    assert hasattr(grpc_module, f"add_{service}Servicer_to_server")
    # The one spelling of its full name the services, authorization and callers use.
    assert (
        getattr(service_names, module.upper()) == pb2.DESCRIPTOR.services_by_name[service].full_name
    )
