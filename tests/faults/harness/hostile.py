"""Hostile and damaged pool files: each costs a miss (a shorter prefix), never wrong KV.

For each kind of bad file, ``scale.corrupt_files`` prompts of ``CHUNKS`` chunks are stored
through a real TieredStore with a pool tier; then one chunk of each prompt (at a random
position) is replaced by a bad file under its valid name. A fresh TieredStore on the same pool
(so no host-DRAM copy hides the files) reads every prompt. Each read must return exactly the
chunks before the bad one, bit-equal to what was stored: a chunk served past it would be the
bad file's bytes taken as KV. Afterwards every bad file must be gone (load removes what fails
validation), counted once in ``corrupt_chunks``, every other chunk must still be there, a new
lookup must stop before the removed chunk, and ``kvtier pool verify`` must find nothing bad.
Symlink targets (a genuine chunk moved out of the pool, another key's chunk inside it, a file
outside) must be untouched and never served.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from _pool import new_pool
from kvtier import KVLayout, StoreConfig, TieredStore, admin
from kvtier.format import (
    HEADER_STRUCT_BYTES,
    PAYLOAD_OFFSET,
    ChunkError,
    ChunkHeader,
    ChunkSpec,
    file_bytes_for,
)
from kvtier.keys import FORMAT_VERSION, ChunkId, Namespace, chunk_ids
from kvtier.layout import DTYPE_CODES
from kvtier.tiers.files import ChunkFiles

from . import FaultRow, Scale, scenario

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
CHUNK_TOKENS = 16
CHUNKS = 4  # per prompt
MODEL_ID = "fault-hostile"
NAMESPACE = Namespace(MODEL_ID, LAYOUT, CHUNK_TOKENS)
PAYLOAD_BYTES = CHUNK_TOKENS * LAYOUT.bytes_per_token
SPEC = ChunkSpec(NAMESPACE.digest, DTYPE_CODES[LAYOUT.dtype], LAYOUT.shape(CHUNK_TOKENS), PAYLOAD_BYTES)
GET_TIMEOUT_S = 5.0


def store_config(pool: Path) -> StoreConfig:
    return StoreConfig(model_id=MODEL_ID, layout=LAYOUT, chunk_tokens=CHUNK_TOKENS, host_bytes=1 << 20,
                       pool_url=new_pool(pool), io_threads=2, read_timeout_s=GET_TIMEOUT_S)


@dataclass
class Prompt:
    tokens: list[int]
    kv: torch.Tensor
    ids: list[ChunkId]
    bad: int = -1
    """Index of the chunk replaced by a bad file (-1: none)."""

    def chunk_kv(self, i: int) -> torch.Tensor:
        return self.kv[:, :, i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS]


@dataclass
class Plant:
    """Everything a kind of bad file may need to build one and to check the aftermath."""

    root: Path
    outside: Path
    """A directory beside the pool (for symlink targets)."""
    prompts: list[Prompt]
    rng: random.Random
    targets: dict[Path, bytes] = field(default_factory=dict)
    """Files a planted symlink points at, and their bytes: they must stay as they were."""
    spared: set[Path] = field(default_factory=set)
    """Chunk files moved out of the pool on purpose (not lost)."""


Planter = Callable[[Plant, int, Path], None]
"""Replace the file at ``path`` (prompt ``i``'s bad chunk) with a bad one."""


def _image(header: ChunkHeader, payload: bytes) -> bytes:
    return header.pack() + payload + bytes(file_bytes_for(len(payload)) - PAYLOAD_OFFSET - len(payload))


def _other_payload(p: Plant) -> bytes:
    return bytes(p.rng.getrandbits(8) for _ in range(PAYLOAD_BYTES))


def _donor(p: Plant, i: int) -> Path:
    """A sound chunk file of another key that no planter touches: the next prompt's chunk
    just after its own bad one."""
    donor = p.prompts[(i + 1) % len(p.prompts)]
    return ChunkFiles(p.root, create=False).path_for(donor.ids[(donor.bad + 1) % CHUNKS].key)


def _bad_chunk(p: Plant, i: int) -> tuple[Prompt, ChunkId]:
    prompt = p.prompts[i]
    return prompt, prompt.ids[prompt.bad]


def bit_flips(p: Plant, i: int, path: Path) -> None:
    # Only bytes that carry meaning: the header's fields and checksum, and the payload. (The
    # zero padding after each is not checksummed, and never reaches a reader as KV.)
    data = bytearray(path.read_bytes())
    meaningful = [*range(HEADER_STRUCT_BYTES), *range(PAYLOAD_OFFSET, PAYLOAD_OFFSET + PAYLOAD_BYTES)]
    for pos in p.rng.sample(meaningful, p.rng.randint(1, 3)):
        data[pos] ^= 1 << p.rng.randrange(8)
    path.write_bytes(bytes(data))


def truncation(p: Plant, i: int, path: Path) -> None:
    os.truncate(path, p.rng.randrange(1, SPEC.file_bytes))


def zero_length(p: Plant, i: int, path: Path) -> None:
    os.truncate(path, 0)


def other_model(p: Plant, i: int, path: Path) -> None:
    # The same tokens stored by another model (even rows) or another tenant of this model
    # (odd rows): a complete, self-consistent chunk, just not this namespace's.
    prompt, _ = _bad_chunk(p, i)
    ns = Namespace("another-model", LAYOUT, CHUNK_TOKENS) if i % 2 == 0 else NAMESPACE.with_salt("other-tenant")
    cid = chunk_ids(ns, prompt.tokens)[prompt.bad]
    payload = _other_payload(p)
    header = ChunkSpec(ns.digest, SPEC.dtype_code, SPEC.shape, PAYLOAD_BYTES).header_for(cid, payload)
    path.write_bytes(_image(header, payload))


def other_layout(p: Plant, i: int, path: Path) -> None:
    # Three ways: the chunk another layout's store wrote for these tokens; and this chunk's own
    # namespace and identity claimed for another dtype (same bytes) or more heads (more bytes).
    prompt, cid = _bad_chunk(p, i)
    variant = i % 3
    if variant == 0:
        layout = KVLayout(LAYOUT.num_layers, 4, LAYOUT.head_dim, LAYOUT.dtype)
        ns = Namespace(MODEL_ID, layout, CHUNK_TOKENS)
        other = chunk_ids(ns, prompt.tokens)[prompt.bad]
        spec = ChunkSpec(ns.digest, DTYPE_CODES[layout.dtype], layout.shape(CHUNK_TOKENS),
                         CHUNK_TOKENS * layout.bytes_per_token)
        payload = bytes(p.rng.getrandbits(8) for _ in range(spec.payload_bytes))
        path.write_bytes(_image(spec.header_for(other, payload), payload))
        return
    if variant == 1:
        spec = replace(SPEC, dtype_code=DTYPE_CODES[torch.float16])
    else:
        spec = replace(SPEC, shape=(LAYOUT.num_layers, 2, CHUNK_TOKENS, 4, LAYOUT.head_dim),
                       payload_bytes=2 * PAYLOAD_BYTES)
    payload = bytes(p.rng.getrandbits(8) for _ in range(spec.payload_bytes))
    path.write_bytes(_image(spec.header_for(cid, payload), payload))


def other_version(p: Plant, i: int, path: Path) -> None:
    # Right namespace, identity and payload, header checksum correct: only the version differs.
    _, cid = _bad_chunk(p, i)
    payload = path.read_bytes()[PAYLOAD_OFFSET:PAYLOAD_OFFSET + PAYLOAD_BYTES]
    version = (FORMAT_VERSION + 1, 0, 0xFFFF)[i % 3]
    path.write_bytes(_image(replace(SPEC.header_for(cid, payload), version=version), payload))


def renamed(p: Plant, i: int, path: Path) -> None:
    # A sound chunk file of another key (which stays where it is) copied under this key's name.
    shutil.copyfile(_donor(p, i), path)


def other_tokens(p: Plant, i: int, path: Path) -> None:
    # This chunk's key and parent, another chunk's token digest, checksums all correct.
    _, cid = _bad_chunk(p, i)
    wrong = ChunkId(cid.key, cid.parent, bytes(reversed(cid.tokens_digest)), cid.extra_digest)
    payload = _other_payload(p)
    path.write_bytes(_image(SPEC.header_for(wrong, payload), payload))


def symlink(p: Plant, i: int, path: Path) -> None:
    # Three targets, none of which may be read: the genuine chunk moved out of the pool (a
    # reader that followed links would serve it and pass every check), another key's chunk
    # inside the pool (removing the link must leave it), a plain file outside the pool.
    variant = i % 3
    if variant == 0:
        target = p.outside / f"genuine-{i}.kvt"
        os.replace(path, target)
        p.spared.add(path)
    elif variant == 1:
        target = _donor(p, i)
    else:
        target = p.outside / f"secret-{i}.txt"
        target.write_bytes(b"not for the pool\n" * 100)
    p.targets[target] = target.read_bytes()
    if path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(target, path)


def fifo(p: Plant, i: int, path: Path) -> None:
    # A plain open of a FIFO with no writer blocks forever.
    path.unlink()
    os.mkfifo(path, 0o600)


KINDS: list[tuple[str, Planter]] = [
    ("bit flips in header or payload", bit_flips),
    ("truncated files", truncation),
    ("zero-length files", zero_length),
    ("chunk of another model or tenant", other_model),
    ("chunk of another layout or dtype", other_layout),
    ("header of another format version", other_version),
    ("another key's chunk renamed", renamed),
    ("right key, other tokens' digest", other_tokens),
    ("symlink under a chunk's name", symlink),
    ("FIFO under a chunk's name", fifo),
]


@scenario("hostile files")
def hostile_files(scale: Scale, work: Path) -> list[FaultRow]:
    return [run_kind(name, planter, scale.corrupt_files, work / f"kind{k}", seed=k)
            for k, (name, planter) in enumerate(KINDS)]


def make_prompts(n: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(0, 50_000) for _ in range(CHUNKS * CHUNK_TOKENS)]
        kv = torch.randn(LAYOUT.shape(len(tokens)), generator=gen).to(LAYOUT.dtype)
        out.append(Prompt(tokens, kv, chunk_ids(NAMESPACE, tokens), bad=rng.randrange(CHUNKS)))
    return out


def read_prefix(store: TieredStore, prompt: Prompt) -> list[torch.Tensor]:
    """The prefix the store serves for ``prompt`` (copies: yielded data is only lent)."""
    return [got.data.clone() for got in store.iter_chunks(prompt.ids)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_kind(name: str, planter: Planter, n: int, work: Path, seed: int) -> FaultRow:
    t0 = time.perf_counter()
    root, outside = work / "pool", work / "outside"
    outside.mkdir(parents=True)
    prompts = make_prompts(n, seed)
    with TieredStore(store_config(root)) as store:
        for prompt in prompts:
            store.put(prompt.tokens, prompt.kv)
        store.flush()
    files = ChunkFiles(root, create=False)
    plant = Plant(root, outside, prompts, random.Random(seed))
    planted: list[Path] = []
    for i, prompt in enumerate(prompts):
        path = files.path_for(prompt.ids[prompt.bad].key)
        planter(plant, i, path)
        planted.append(path)
    faults = collections.Counter(_fault_of(files, p) for p in prompts)

    row = FaultRow(name, injected=len(planted))
    short = past_bad = 0
    with TieredStore(store_config(root)) as store:
        for prompt in prompts:
            row.requests += 1
            try:
                got = read_prefix(store, prompt)
            except Exception:
                continue
            row.served += 1
            equal = all(_bits_equal(kv, prompt.chunk_kv(c)) for c, kv in enumerate(got))
            past_bad += len(got) > prompt.bad
            short += len(got) < prompt.bad
            if not equal or len(got) > prompt.bad:
                row.wrong += 1
            elif len(got) == prompt.bad:
                row.identical += 1
        corrupt = int(store.metrics_snapshot()["tiers"]["pool"]["corrupt_chunks"])
        stops = sum(store.lookup(p.tokens).num_chunks == p.bad for p in prompts)

    removed = sum(not os.path.lexists(p) for p in planted)
    bad_paths = set(planted) | plant.spared
    row.lost = sum(not files.path_for(cid.key).exists()
                   for p in prompts for cid in p.ids if files.path_for(cid.key) not in bad_paths)
    targets_intact = sum(t.is_file() and not t.is_symlink() and t.read_bytes() == data
                         for t, data in plant.targets.items())
    report = admin.verify(root)
    row.seconds = time.perf_counter() - t0
    row.extra = {"corrupt_chunks": corrupt, "removed": removed, "lookup_stops_before_bad": stops,
                 "short_prefixes": short, "served_past_bad": past_bad, "faults": dict(faults),
                 "symlink_targets": len(plant.targets), "symlink_targets_intact": targets_intact,
                 "verify_checked": report.checked, "verify_bad": len(report.bad)}
    row.notes = (f"rejected as {', '.join(f'{k} {v}' for k, v in sorted(faults.items()))}; corrupt_chunks "
                 f"counted {corrupt}; {removed}/{len(planted)} bad files removed; verify after: "
                 f"{len(report.bad)} bad of {report.checked}")
    if plant.targets:
        row.notes += f"; {targets_intact}/{len(plant.targets)} symlink targets untouched"
    return row


def _fault_of(files: ChunkFiles, prompt: Prompt) -> str:
    """How a reader rejects the planted file (``read`` validates and changes nothing)."""
    try:
        files.read(prompt.ids[prompt.bad], SPEC)
    except ChunkError as exc:
        return exc.fault.value
    except OSError as exc:
        return f"os error {exc.errno}"
    return "accepted"
