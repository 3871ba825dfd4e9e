"""The ``ChunkSpec`` of each namespace a store serves, and the codec its files are written with.

Bounded whatever clients send (every ``cache_salt`` is a namespace): at most ``MAX_SPECS`` specs
are kept (least recently used dropped; one is rebuilt in microseconds), and at most
``MAX_DESCRIBED`` namespaces are described per process in the disk and pool directories (the
rest are counted in ``undescribed_namespaces``; their chunks are served all the same).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.codec import KVGeometry, encoder_for
from kvtier.format import ChunkSpec
from kvtier.keys import Namespace
from kvtier.layout import DTYPE_CODES, KVLayout
from kvtier.metrics import TierMetrics
from kvtier.threads import Failures
from kvtier.tiers.base import Tier

MAX_SPECS = 4096  # chunk specs kept, one per namespace (each cache_salt is one)
MAX_DESCRIBED = 256  # namespaces a process describes in the disk and pool directories


class Specs:
    """Thread-safe; ``get`` is the store's only way to a spec."""

    def __init__(self, layout: KVLayout, chunk_tokens: int, kv_codec: str, tiers: Sequence[Tier],
                 failures: Failures, metrics: TierMetrics) -> None:
        self.layout, self.chunk_tokens, self.kv_codec = layout, chunk_tokens, kv_codec
        self._tiers, self._failures, self._metrics = tiers, failures, metrics
        self._specs: OrderedDict[bytes, ChunkSpec] = OrderedDict()  # by namespace digest, LRU
        self._described: set[bytes] = set()
        self._lock = threading.Lock()
        self._encoder = encoder_for(kv_codec, layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                    chunk_tokens)

    def __len__(self) -> int:
        return len(self._specs)

    def get(self, namespace: Namespace) -> ChunkSpec:
        """The spec of chunks in ``namespace``. The first time a namespace is seen, every tier
        records what it is (the disk and pool directories: a small JSON file each)."""
        digest = namespace.digest
        with self._lock:
            spec = self._specs.get(digest)
            if spec is not None:
                self._specs.move_to_end(digest)
                return spec
            spec = ChunkSpec(digest, DTYPE_CODES[self.layout.dtype], self.layout.shape(self.chunk_tokens),
                             self.chunk_tokens * self.layout.bytes_per_token, self._encoder)
            self._specs[digest] = spec
            if len(self._specs) > MAX_SPECS:
                self._specs.popitem(last=False)
            describe = digest not in self._described and len(self._described) < MAX_DESCRIBED
            if describe:
                self._described.add(digest)
        if describe:
            for tier in self._tiers:
                self._failures.call(f"the {tier.name} tier's describe_namespace", tier.describe_namespace,
                                    digest, namespace.describe())
        elif digest not in self._described:
            self._metrics.add(undescribed_namespaces=1)
        return spec

    def set_geometry(self, geometry: KVGeometry) -> None:
        """Where K and V sit in the chunks, for the codec (``TieredStore.set_codec_geometry``)."""
        lay = self.layout
        with self._lock:
            self._encoder = encoder_for(self.kv_codec, lay.dtype, lay.num_layers, lay.num_kv_heads, lay.head_dim,
                                        self.chunk_tokens, geometry)
            self._specs.clear()  # rebuilt with the encoder; namespaces stay described
