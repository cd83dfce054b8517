"""aetcd over TLS: the channel credentials of an `EtcdSecurity` and a client dialling with them."""

import asyncio
from typing import Any

import aetcd
import aetcd.rpc
import aetcd.watcher
import grpc

from relaygr.etcd.security import EtcdSecurity
from relaygr.tls import read_pem


def channel_credentials(security: EtcdSecurity) -> grpc.ChannelCredentials | None:
    """TLS credentials for etcd (None: plaintext); ConfigError when a PEM file is unreadable."""
    if not security.tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(security.ca, "etcd_ca"),
        private_key=read_pem(security.key, "etcd_key"),
        certificate_chain=read_pem(security.cert, "etcd_cert"),
    )


class TlsAetcdClient(aetcd.Client):  # type: ignore[misc]
    """An aetcd client over TLS: aetcd 1.0.0 only dials plaintext.

    `connect` builds what aetcd's own does (channel, optional Authenticate, stubs, watcher) on a
    secure channel; it relies on aetcd 1.0.0's attribute names, so check it when aetcd (pinned
    in pyproject.toml) is upgraded. gRPC errors raised here reach the caller through the public
    method that connected, which maps them to aetcd's exceptions.
    """

    _is_connecting: bool  # aetcd's own attributes, set by its __init__

    def __init__(
        self, host: str, port: int, credentials: grpc.ChannelCredentials, **kwargs: Any
    ) -> None:
        aetcd.Client.__init__(self, host, port, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        channel = grpc.aio.secure_channel(
            f"{self._host}:{self._port}", self._credentials, options=list(self._options.items())
        )
        try:
            metadata = None
            if self._username is not None:
                request = aetcd.rpc.AuthenticateRequest(
                    name=self._username, password=self._password
                )
                reply = await aetcd.rpc.AuthStub(channel).Authenticate(
                    request, timeout=self._timeout
                )
                metadata = (("token", reply.token),)
        except BaseException:
            await channel.close()
            raise
        finally:
            self._is_connecting = False
        self.channel, self.metadata = channel, metadata
        self.kvstub = aetcd.rpc.KVStub(channel)
        self.clusterstub = aetcd.rpc.ClusterStub(channel)
        self.leasestub = aetcd.rpc.LeaseStub(channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(channel)
        self._watcher = aetcd.watcher.Watcher(
            aetcd.rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata
        )
        self._connected.set()
