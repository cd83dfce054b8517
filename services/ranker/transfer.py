"""A cached prefix between rankers: its header, its payload bytes, and the checks on receipt.

Pure of transport: the service turns `EntryHeader` into a `relaygr.v1.PrefixHeader` and the
payload into `PrefixChunk.data` pieces of `CHUNK_BYTES`, and back. The payload is the prefix's
K, V (each in the storage dtype) and int64 timestamps, each C-contiguous and in this host's byte
order (little-endian on every platform we serve on), concatenated.

A received entry is served only once every check holds: the header names the receiver's model
version and storage dtype, its byte count is exactly `num_tokens * cache_bytes_per_token` of
the receiver's model (so nothing larger than one prefix is ever buffered), and the BLAKE2b
content digest over the header and payload matches. The cache key's prefix digest cannot be
recomputed without the prefix inputs, which the sender no longer holds: it is trusted from a
peer that passed the other checks, like the rest of the cache it computed under the same model.
"""

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

import torch

from relaygr.behaviours import UserId
from services.ranker.digest import PrefixDigest, PrefixHasher
from services.ranker.kv_store import CacheKey
from services.ranker.model_config import ModelConfig
from services.ranker.prefix_kv import ModelVersion, PrefixKV

CHUNK_BYTES = 1 << 20  # one PrefixChunk.data: well under gRPC's default 4 MiB message limit


class Refusal(StrEnum):
    """Why a received entry is not admitted."""

    WRONG_VERSION = "wrong_version"  # computed under another model
    WRONG_DTYPE = "wrong_dtype"  # stored in another dtype than this ranker's tiers
    BAD_SHAPE = "bad_shape"  # token counts or byte count that this model cannot hold
    CORRUPT = "corrupt"  # content digest mismatch: altered or truncated on the way
    NO_ROOM = "no_room"  # checks passed; no tier could hold it within its budget
    MALFORMED = "malformed"  # chunks out of order: data before a header, a header mid-entry
    HELD = "held"  # the receiver holds another prefix of the user: its own is kept
    COMPUTING = "computing"  # the receiver is computing that prefix itself: one computation wins


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """What precedes an entry's payload (the fields of `relaygr.v1.PrefixHeader`)."""

    user_id: str
    model_version: str
    prefix_digest: str
    num_user_tokens: int
    num_tokens: int
    kv_dtype: str
    nbytes: int
    content_digest: str
    origin_traceparent: str = ""

    @property
    def key(self) -> CacheKey:
        return CacheKey(
            UserId(self.user_id), ModelVersion(self.model_version), PrefixDigest(self.prefix_digest)
        )


def _content_digest(header: EntryHeader, payload: bytes | bytearray) -> str:
    state = hashlib.blake2b(digest_size=16, person=b"relaygr-xfer1")
    fields = (
        header.user_id, header.model_version, header.prefix_digest, str(header.num_user_tokens),
        str(header.num_tokens), header.kv_dtype, str(header.nbytes),
    )  # fmt: skip
    for text in fields:
        encoded = text.encode()
        state.update(len(encoded).to_bytes(4, "little") + encoded)
    state.update(payload)
    return state.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes (any dtype: bfloat16 has no numpy type, so through uint8)."""
    flat = t.detach().cpu().reshape(-1)
    if flat.stride(-1) != 1:  # one element broadcast (stride 0) counts as contiguous as it is
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().tobytes()


def encode(key: CacheKey, kv: PrefixKV, origin_traceparent: str = "") -> tuple[EntryHeader, bytes]:
    """The header and payload of the cached prefix `kv` held under `key`."""
    parts = [_tensor_bytes(t) for t in (kv.keys, kv.values, kv.timestamps)]
    payload = b"".join(parts)
    draft = EntryHeader(
        user_id=key.user_id,
        model_version=key.model_version,
        prefix_digest=key.digest,
        num_user_tokens=kv.num_user_tokens,
        num_tokens=kv.num_tokens,
        kv_dtype=str(kv.keys.dtype).removeprefix("torch."),
        nbytes=len(payload),
        content_digest="",
        origin_traceparent=origin_traceparent,
    )
    digest = _content_digest(draft, payload)
    return _with_digest(draft, digest), payload


def _with_digest(header: EntryHeader, digest: str) -> EntryHeader:
    return EntryHeader(
        header.user_id, header.model_version, header.prefix_digest, header.num_user_tokens,
        header.num_tokens, header.kv_dtype, header.nbytes, digest, header.origin_traceparent,
    )  # fmt: skip


def chunks(payload: bytes, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """The payload in pieces of at most `size` bytes (none for an empty payload)."""
    view = memoryview(payload)
    for start in range(0, len(view), size):
        yield view[start : start + size]


def check_header(header: EntryHeader, cfg: ModelConfig, model_version: str) -> Refusal | None:
    """The checks a header must pass before any of its payload is buffered."""
    if header.model_version != model_version:
        return Refusal.WRONG_VERSION
    if header.kv_dtype != cfg.kv_dtype.value:
        return Refusal.WRONG_DTYPE
    tokens, users = header.num_tokens, header.num_user_tokens
    if not header.user_id or not header.prefix_digest:
        return Refusal.MALFORMED
    if not 0 < tokens <= cfg.max_history_tokens or not 0 <= users <= min(
        tokens, cfg.max_user_features
    ):
        return Refusal.BAD_SHAPE
    if header.nbytes != tokens * cfg.cache_bytes_per_token:
        return Refusal.BAD_SHAPE
    return None


class Receiver:
    """Assembles one entry at a time from a stream of headers and data pieces.

    Invariants: it never holds more payload than the current header's `nbytes`, which
    `check_header` bounds by one prefix of this model; a header that fails its checks makes the
    receiver skip that entry's data; `finish` returns a prefix only when every check holds.
    """

    def __init__(self, cfg: ModelConfig, model_version: str, device: torch.device) -> None:
        self._cfg = cfg
        self._version = model_version
        self._device = device
        self._header: EntryHeader | None = None
        self._refused: Refusal | None = None
        self._buffer = bytearray()

    @property
    def header(self) -> EntryHeader | None:
        """The entry being received (None before the first header)."""
        return self._header

    def start(self, header: EntryHeader) -> Refusal | None:
        """Begin a new entry; the previous one must have been finished."""
        self._header, self._buffer = header, bytearray()
        self._refused = check_header(header, self._cfg, self._version)
        return self._refused

    def add(self, data: bytes) -> Refusal | None:
        """Take a piece of the current entry's payload; a refusal ends the entry's chances."""
        if self._header is None:
            return Refusal.MALFORMED
        if self._refused is not None:
            return self._refused
        if len(self._buffer) + len(data) > self._header.nbytes:
            self._refused, self._buffer = Refusal.CORRUPT, bytearray()
            return self._refused
        self._buffer += data
        return None

    def finish(self) -> PrefixKV | Refusal:
        """The current entry, checked, on this ranker's device; or why it is refused."""
        header, payload, refused = self._header, self._buffer, self._refused
        self._header, self._buffer, self._refused = None, bytearray(), None
        if header is None:
            return Refusal.MALFORMED
        if refused is not None:
            return refused
        if len(payload) != header.nbytes:
            return Refusal.CORRUPT
        if _content_digest(header, payload) != header.content_digest:
            return Refusal.CORRUPT
        return _decode(header, payload, self._cfg, self._device)


def _decode(
    header: EntryHeader, payload: bytearray, cfg: ModelConfig, device: torch.device
) -> PrefixKV:
    dtype = cfg.kv_dtype.torch_dtype
    tokens = header.num_tokens
    layers, heads = cfg.num_layers, cfg.num_heads
    k_bytes, v_bytes = tokens * cfg.k_bytes_per_token, tokens * cfg.v_bytes_per_token
    raw = torch.frombuffer(payload, dtype=torch.uint8)

    def piece(start: int, length: int, dt: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return raw[start : start + length].view(dt).reshape(shape).clone().to(device)

    keys = piece(0, k_bytes, dtype, (layers, heads, tokens, cfg.d_qk))
    values = piece(k_bytes, v_bytes, dtype, (layers, heads, tokens, cfg.d_v))
    timestamps = piece(k_bytes + v_bytes, tokens * 8, torch.int64, (tokens,))
    return PrefixKV(
        keys=keys,
        values=values,
        timestamps=timestamps,
        num_user_tokens=header.num_user_tokens,
        hasher=PrefixHasher.sealed(PrefixDigest(header.prefix_digest)),
        model_version=ModelVersion(header.model_version),
    )
