"""Chunk keys: the one place that turns token ids into storage keys.

A key is deterministic across processes and machines: it is a BLAKE3 digest of bytes only
(no Python ``hash``, no ``PYTHONHASHSEED``), with token ids encoded as little-endian uint32.

    tokens_digest(i) = BLAKE3(token ids of chunk i)
    key(i)           = BLAKE3(key(i-1) || tokens_digest(i) || extra_digest)
    key(-1)          = namespace digest

A *tail* (``tail_id``: the tokens after a prefix's last full chunk, fewer than a chunk) is
chained on that chunk's key the same way, with an extra digest that names it a tail of so
many tokens.

The namespace digest covers everything that changes the stored bytes (model and the content
of its weights, dtype, layout, chunk size, parallel rank/size, format version, tenant salt), so
KV of one model or tenant can never be addressed by another. Hashing the token digest rather than the tokens lets
``kvtier pool verify`` recheck a key from a chunk header alone (parent key + token digest).
"""

from __future__ import annotations

import array
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NewType

import numpy as np
import torch
from blake3 import blake3

from kvtier.layout import KVLayout

FORMAT_VERSION = 1
DIGEST_BYTES = 32

ChunkKey = NewType("ChunkKey", bytes)
"""32-byte chained digest naming one chunk of KV."""

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a chunk; its digest seeds every key chain."""

    model_id: str
    layout: KVLayout
    chunk_tokens: int
    rank: int = 0
    world_size: int = 1
    tenant_salt: str = ""
    format_version: int = FORMAT_VERSION
    kv_format: str = "kvtier"
    """How the payload bytes are laid out: ``kvtier`` (the canonical ``[layers, 2, tokens,
    heads, head_dim]``) or an engine's own paged format (e.g. ``vllm-cpu-vec-bs128``)."""
    model_digest: str = ""
    """The content of the model's weights and config (``identity.py``): new
    weights behind the same ``model_id`` get a namespace of their own. Empty: not known (the
    field is then left out of the digest, so namespaces made without it keep theirs)."""
    weights_digest: str = ""
    """The weights' content alone (``identity.content_digest``), described beside the pool so that
    ``kvtier doctor --model DIR`` can tell "other weights" from other differences. Descriptive
    only: ``model_digest`` already keys the weights, so it is not in ``digest``."""
    kv_codec: str = ""
    """A lossy codec and its version (``codec.namespace_tag``): exact and lossy KV never share
    keys. Empty (no codec, or a lossless one) is left out of the digest."""

    def describe(self) -> dict[str, object]:
        """Canonical, human-readable fields (written beside pool data for `pool stats`)."""
        extra: dict[str, object] = {"model_digest": self.model_digest} if self.model_digest else {}
        if self.weights_digest:
            extra["weights_digest"] = self.weights_digest
        if self.kv_codec:
            extra["kv_codec"] = self.kv_codec
        return {**extra,
            "format_version": self.format_version,
            "model_id": self.model_id,
            "layout": self.layout.to_dict(),
            "chunk_tokens": self.chunk_tokens,
            "rank": self.rank,
            "world_size": self.world_size,
            "kv_format": self.kv_format,
            # The salt itself is a secret of the tenant: only its digest is described.
            "tenant": blake3(self.tenant_salt.encode()).hexdigest()[:16] if self.tenant_salt else "",
        }

    @property
    def digest(self) -> bytes:
        fields = dict(self.describe(), tenant_salt=self.tenant_salt)
        fields.pop("weights_digest", None)
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return blake3(b"kvtier-namespace\0" + canonical).digest()

    def with_salt(self, tenant_salt: str) -> Namespace:
        return replace(self, tenant_salt=tenant_salt)


@dataclass(frozen=True)
class ChunkId:
    """Identity of one chunk: its key, its parent key and the digest of its token ids.

    Stored in every chunk header; a read is accepted only if all three match what the reader
    computed from its own tokens (guards against hash collisions and misplaced files).
    """

    key: ChunkKey
    parent: bytes
    tokens_digest: bytes
    extra_digest: bytes = b""


def as_token_array(tokens: TokenIds) -> np.ndarray:
    """Token ids as a little-endian uint32 numpy array (no copy when already one)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.dtype != np.uint32:
            if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
                raise ValueError("token ids must be in [0, 2**32)")
            tokens = tokens.astype("<u4")
        return tokens
    if isinstance(tokens, array.array) and tokens.itemsize == 4 and tokens.typecode in "iIlL":
        # vLLM 0.34's TokenBuffer (an int32 array): read in place, not token by token.
        ids = np.frombuffer(tokens, dtype=np.int32 if tokens.typecode in "il" else np.uint32)
        if ids.dtype == np.int32 and ids.size and ids.min() < 0:
            raise ValueError("token ids must be in [0, 2**32)")
        return ids.view(np.uint32)
    try:
        # array.array converts a list of ints about 3x faster than np.asarray.
        return np.frombuffer(array.array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None


def chunk_ids(namespace: Namespace, tokens: TokenIds, extra: bytes = b"",
              max_chunks: int | None = None) -> list[ChunkId]:
    """Identities of the full chunks of ``tokens`` (a trailing partial chunk has none).

    ``extra`` is mixed into every key (e.g. multimodal content hashes, LoRA id).
    """
    ids = as_token_array(tokens)
    n = len(ids) // namespace.chunk_tokens
    if max_chunks is not None:
        n = min(n, max_chunks)
    raw = memoryview(ids[: n * namespace.chunk_tokens].tobytes()) if n else memoryview(b"")
    step = namespace.chunk_tokens * 4
    extra_digest = blake3(extra).digest() if extra else b""
    parent = namespace.digest
    out: list[ChunkId] = []
    for i in range(n):
        tokens_digest = blake3(raw[i * step:(i + 1) * step]).digest()
        key = ChunkKey(blake3(parent + tokens_digest + extra_digest).digest())
        out.append(ChunkId(key, parent, tokens_digest, extra_digest))
        parent = key
    return out


TAIL_PARTS = 4
"""Tails (``tail_id``) are saved and looked for in steps of ``chunk_tokens / TAIL_PARTS``
or one block, whichever is larger: at most ``TAIL_PARTS - 1`` extra lookups per request."""


def tail_step(chunk_tokens: int, block_size: int) -> int:
    """The tokens of one step of a tail (a multiple of ``block_size``); 0: a chunk is one block."""
    step = -(-max(block_size, chunk_tokens // TAIL_PARTS) // block_size) * block_size
    return step if step < chunk_tokens else 0


def tail_id(namespace: Namespace, tokens: TokenIds, start: int, n: int, parent: bytes | None = None,
            extra: bytes = b"") -> ChunkId:
    """The identity of a *tail*: the ``n`` tokens from ``start`` (a multiple of ``chunk_tokens``)
    that follow a prefix's last full chunk, ``0 < n < chunk_tokens``.

    A tail is stored like a chunk (the payload of a full chunk, of which only the first ``n``
    tokens' blocks are ever read) under a key chained on the last full chunk's key (``parent``;
    None: the namespace digest, a prompt shorter than one chunk). Its extra digest marks it a
    tail of ``n`` tokens, so a tail can never be read as a full chunk or as a tail of another
    length, and ``recompute_key`` still verifies it from its header alone.
    """
    if start % namespace.chunk_tokens or not 0 < n < namespace.chunk_tokens:
        raise ValueError(f"a tail is 1..{namespace.chunk_tokens - 1} tokens from a chunk boundary, "
                         f"got {n} from {start}")
    if (parent is None) != (start == 0):
        raise ValueError("a tail's parent is the key of the full chunk before it (None only from token 0)")
    ids = as_token_array(tokens)
    if start + n > len(ids):
        raise ValueError(f"a tail of {n} tokens from {start} is past the {len(ids)} tokens given")
    tokens_digest = blake3(ids[start:start + n].tobytes()).digest()
    extra_digest = _tail_extra(blake3(extra).digest() if extra else b"", n)
    parent = namespace.digest if parent is None else parent
    return ChunkId(recompute_key(parent, tokens_digest, extra_digest), parent, tokens_digest, extra_digest)


def _tail_extra(extra_digest: bytes, n: int) -> bytes:
    return blake3(b"kvtier-tail\0" + extra_digest + n.to_bytes(4, "little")).digest()


def recompute_key(parent: bytes, tokens_digest: bytes, extra_digest: bytes = b"") -> ChunkKey:
    """The key a chunk header's parent and token digest imply (used by `pool verify`)."""
    return ChunkKey(blake3(parent + tokens_digest + extra_digest).digest())


def shard_id(cid: ChunkId, shard: int, num_shards: int) -> ChunkId:
    """The identity of shard ``shard`` of ``num_shards`` of the logical chunk ``cid``.

    A chunk's KV is stored as one chunk per shard: per KV head (so that any tensor-parallel
    size reads it), or per tensor-parallel rank where heads cannot be addressed. A shard keeps
    the logical chunk's parent and token digest and gets its own extra digest (the logical extra
    digest, the shard and the shard count), so ``recompute_key`` still verifies it from its
    header alone, a shard can never be read as another shard or as the whole, and the logical
    key chain stays rank-independent (the scheduler computes one chain for all ranks).
    ``num_shards == 1`` returns ``cid``.
    """
    if num_shards == 1:
        return cid
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    extra = _shard_extra(cid.extra_digest, shard, num_shards)
    return ChunkId(recompute_key(cid.parent, cid.tokens_digest, extra), cid.parent, cid.tokens_digest, extra)


@functools.lru_cache(maxsize=4096)
def _shard_extra(extra_digest: bytes, shard: int, num_shards: int) -> bytes:
    # The same for every chunk of a request (one extra digest): cached, a shard id costs one hash.
    return blake3(b"kvtier-shard\0" + extra_digest + shard.to_bytes(4, "little")
                  + num_shards.to_bytes(4, "little")).digest()
