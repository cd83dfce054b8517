"""Client channels that follow renewed certificates: a channel reads its TLS files when it
opens, so its owner opens a new one when they change and lets the old one finish its calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import grpc

from relaygr.cert_files import CertificateFiles, check_key_matches, tls_paths
from relaygr.errors import ConfigError
from relaygr.tls import ChannelOption, open_channel, read_pem
from relaygr.tls_settings import TlsSettings

_log = logging.getLogger(__name__)
CHECK_INTERVAL_S = 1.0  # how stale a renewal may be before channels follow it
RETIRE_GRACE_S = 60.0  # calls in flight on a retired channel get this long to finish
Stub = TypeVar("Stub")


class ChannelRenewal:
    """Whether the TLS files behind a client's channels changed since its channels opened
    (looked at once per `interval_s`; never under plaintext), and the retiring of old channels:
    closed in the background with `grace_s` for their calls, so no call fails for a renewal."""

    def __init__(
        self,
        settings: TlsSettings,
        interval_s: float = CHECK_INTERVAL_S,
        grace_s: float = RETIRE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._files = (
            None if settings.plaintext else CertificateFiles(tls_paths(settings), interval_s, clock)
        )
        if self._files is not None:
            self._files.changed()  # what channels opened from now on read
        self._grace_s = grace_s
        self._retiring: set[asyncio.Task[None]] = set()
        self.renewals = 0  # times the channels were replaced

    def due(self) -> bool:
        """True once after the files change and hold a key that matches its certificate: open
        new channels now. Files caught mid-update are looked at again on the next check."""
        if self._files is None or not self._files.changed():
            return False
        try:
            cert = read_pem(self._settings.tls_cert, "tls_cert")
            key = read_pem(self._settings.tls_key, "tls_key")
            if cert is not None and key is not None:
                check_key_matches(cert, key)
        except ConfigError as err:
            _log.warning("renewed TLS files not taken yet (%s); keeping the open channels", err)
            self._files.forget()
            return False
        self.renewals += 1
        return True

    def retire(self, channels: Iterable[grpc.aio.Channel]) -> None:
        """Close `channels` in the background once their calls end (at most `grace_s`)."""
        loop = asyncio.get_running_loop()
        for channel in channels:
            task = loop.create_task(channel.close(self._grace_s))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        """Wait for the retired channels to close."""
        await asyncio.gather(*self._retiring, return_exceptions=True)


class RenewingChannel:
    """One channel to `address` that is opened again when the TLS files change."""

    def __init__(
        self,
        address: str,
        settings: TlsSettings,
        options: Sequence[ChannelOption] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        renewal: ChannelRenewal | None = None,
    ) -> None:
        self._open = lambda: open_channel(address, settings, options, interceptors)
        self._renewal = renewal or ChannelRenewal(settings)
        self._channel = self._open()
        self._stubs: dict[Callable[[grpc.aio.Channel], object], object] = {}

    def current(self) -> grpc.aio.Channel:
        if self._renewal.due():
            _log.info("TLS files changed: opening a new channel with the renewed certificates")
            self._renewal.retire([self._channel])
            self._channel = self._open()
            self._stubs.clear()
        return self._channel

    def stub(self, factory: Callable[[grpc.aio.Channel], Stub]) -> Stub:
        """`factory(channel)` for the current channel, built once per channel."""
        channel = self.current()
        stub = self._stubs.get(factory)
        if stub is None:
            stub = self._stubs[factory] = factory(channel)
        return stub  # type: ignore[return-value]

    async def close(self) -> None:
        await self._channel.close()
        await self._renewal.close()
