"""Coverage-guided fuzzing of chunk files with atheris: run on purpose, not in CI.

    pip install atheris
    python tests/faults/fuzz_header.py -max_total_time=600 [CORPUS_DIR ...]

The first byte of each input picks the target and whether the header checksum is recomputed
over the (fuzzed) fields, so the fuzzer also gets past the checksum into the version, layout,
size and identity checks; the rest is the file image:

* ``unpack_header``: returns a ChunkHeader or raises ChunkError;
* ``ChunkSpec.decode`` against a fixed chunk: returns a view of exactly ``payload_bytes`` of
  the buffer or raises ChunkError;
* ``admin.check_file`` on a file holding the image: returns a ChunkFault or None, never
  reads past the file.

Anything else (another exception, a wrong-sized view) is a crash atheris reports with the
input that caused it. With no corpus directory given, one is made holding a valid image.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris
import numpy  # noqa: F401  (imported before instrumentation: only kvtier is instrumented)
import torch

with atheris.instrument_imports(include=["kvtier"]):
    from kvtier import admin
    from kvtier.format import (
        HEADER_STRUCT_BYTES,
        PAYLOAD_OFFSET,
        ChunkError,
        ChunkFault,
        ChunkSpec,
        seal_header,
        unpack_header,
    )
    from kvtier.keys import Namespace, chunk_ids
    from kvtier.layout import DTYPE_CODES, KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
NAMESPACE = Namespace("fuzz", LAYOUT, 16)
SPEC = ChunkSpec(NAMESPACE.digest, DTYPE_CODES[LAYOUT.dtype], LAYOUT.shape(16), 16 * LAYOUT.bytes_per_token)
CHUNK = chunk_ids(NAMESPACE, list(range(16)))[0]
WORK = Path(tempfile.mkdtemp(prefix="kvtier-fuzz-"))
atexit.register(shutil.rmtree, WORK, True)  # atheris ends the process with sys.exit
FILE = WORK / f"{CHUNK.key.hex()}.kvt"


def valid_image() -> bytes:
    payload = bytes(range(256)) * (SPEC.payload_bytes // 256)
    image = SPEC.header_for(CHUNK, payload).pack() + payload
    return image + bytes(SPEC.file_bytes - len(image))


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, image = data[0], bytearray(data[1:])
    if mode & 4 and len(image) >= HEADER_STRUCT_BYTES:
        seal_header(image)
    buf = bytes(image)
    target = mode % 3
    if target == 0:
        try:
            unpack_header(buf)
        except ChunkError:
            pass
    elif target == 1:
        try:
            view = SPEC.decode(memoryview(buf), CHUNK)
        except ChunkError:
            return
        assert view.obj is buf and view.nbytes == SPEC.payload_bytes
        assert bytes(view) == buf[PAYLOAD_OFFSET:PAYLOAD_OFFSET + SPEC.payload_bytes]
    else:
        FILE.write_bytes(buf)
        fault = admin.check_file(FILE)
        assert fault is None or isinstance(fault, ChunkFault)


def main() -> None:
    args = sys.argv
    if not any(not a.startswith("-") for a in args[1:]):
        corpus = WORK / "corpus"
        corpus.mkdir()
        for mode in range(6):
            (corpus / f"valid-{mode}").write_bytes(bytes([mode]) + valid_image())
        args = [*args, str(corpus)]
    print(f"kvtier fuzz: work dir {WORK}", file=sys.stderr)
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
