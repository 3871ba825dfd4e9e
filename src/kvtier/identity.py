"""What a model and a LoRA adapter *are*, beyond their paths: the identity that enters the keys
(engine-free: the vLLM and SGLang integrations both use it).

KV bytes depend on the weights, not on where they lie. A namespace keyed by the model's path
alone serves the old weights' KV once an operator points ``/models/current`` at new ones (or
another ``--revision``, another quantization, RoPE scaling through ``hf_overrides``, new KV
scales), and a LoRA keyed by its name serves the old adapter's. So kvtier keys:

* **the model** by a digest of: the model's final Hugging Face config (``hf_config`` after
  ``hf_overrides``: RoPE, layer count, ...), the revision, the quantization method, the load
  format (and the seed for ``dummy`` weights, which are generated from it), and the *content*
  of its weight files (``content_digest``);
* **a LoRA adapter** by the content digest of its directory (``AdapterIdentities``, cached per
  adapter until a file's size or mtime changes).

``content_digest`` reads a bounded sample of each file, never the whole of a 1 TB checkpoint:
its name and size, its first and last 64 KiB and 14 blocks of 16 KiB spread evenly between
(about 300 KiB per file). A file stored in the Hugging Face cache (a symlink into
``blobs/<sha256>``) is identified by its blob's name, which *is* its content hash. Two models
that differ only in bytes none of the samples covers would share keys; retrained or re-seeded
weights differ everywhere. Deterministic across processes and machines: the same files give
the same digest wherever they are mounted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from blake3 import blake3

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
META_FILES = ("config.json", "adapter_config.json", "quantize_config.json", "quant_config.json",
              "hf_quant_config.json", "model.safetensors.index.json")
EDGE_BYTES = 64 << 10
INNER_BLOCKS, INNER_BYTES = 14, 16 << 10
WHOLE_BELOW = 4 << 20  # files this small are hashed whole
_BLOB = re.compile(r"^[0-9a-f]{40,64}$")


def _file_digest(path: Path) -> bytes:
    """Identity of one file's content: its HF blob name, or a sample of its bytes (module doc)."""
    try:
        real = path.resolve()
        if path.is_symlink() and real.parent.name == "blobs" and _BLOB.match(real.name):
            return blake3(b"blob\0" + real.name.encode()).digest()
    except OSError:
        pass
    h = blake3(b"sample\0")
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        if size <= WHOLE_BELOW:
            h.update(fh.read())
            return h.digest()
        offsets = [0, size - EDGE_BYTES]
        step = (size - 2 * EDGE_BYTES) // (INNER_BLOCKS + 1)
        offsets[1:1] = [EDGE_BYTES + step * (i + 1) for i in range(INNER_BLOCKS)]
        for offset in offsets:
            n = EDGE_BYTES if offset in (0, size - EDGE_BYTES) else INNER_BYTES
            h.update(os.pread(fh.fileno(), n, offset))
    return h.digest()


def _content_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*")):
        if path.name.startswith("."):
            continue
        if path.is_file() and (path.name.endswith(WEIGHT_SUFFIXES) or path.name in META_FILES):
            files.append(path)
    return files


def content_digest(root: str | os.PathLike[str]) -> str:
    """Hex digest of the weight and config files under ``root`` (their names relative to it,
    and their content as ``_file_digest`` samples it); ``""`` when ``root`` holds none."""
    base = Path(root)
    files = _content_files(base)
    if not files:
        return ""
    h = blake3(b"kvtier-model-content\0")
    for path in files:
        h.update(str(path.relative_to(base)).encode() + b"\0" + _file_digest(path))
    return h.hexdigest()


def has_weights(root: str | os.PathLike[str]) -> bool:
    """``root`` holds at least one weight file (``WEIGHT_SUFFIXES``), not only configs."""
    return any(p.name.endswith(WEIGHT_SUFFIXES) for p in _content_files(Path(root)))


def local_dir(model: str, revision: str | None, cache_dir: str | None = None) -> Path | None:
    """The directory holding ``model``'s weights: itself, or its snapshot in the Hugging Face
    cache the engine downloads to (``cache_dir``: vLLM's ``--download-dir``; None: the default
    cache). A directory without weight files (a config-only download) is not the model: None."""
    if os.path.isdir(model):
        root = Path(model)
    else:
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(model, revision=revision, local_files_only=True, cache_dir=cache_dir))
        except Exception:  # not cached here, no huggingface_hub, an offline error: name and revision only
            return None
    return root if has_weights(root) else None


def _default(value: Any) -> str:
    # str() of an object without a JSON form; never its memory address, which differs between
    # the scheduler's and the workers' processes (their keys must agree).
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=_default))


def model_identity(vllm_config: Any) -> dict[str, str]:
    """What identifies the model's weights and config (module docstring), as strings."""
    mc = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load, "load_format", "auto"))
    info: dict[str, str] = {
        "revision": str(getattr(mc, "revision", None) or ""),
        "quantization": str(getattr(mc, "quantization", None) or ""),
        "load_format": load_format,
    }
    if load_format == "dummy":
        info["seed"] = str(getattr(mc, "seed", ""))
    hf_config = getattr(mc, "hf_config", None)
    if hf_config is not None:
        to_dict = getattr(hf_config, "to_dict", None)
        config = to_dict() if callable(to_dict) else vars(hf_config)
        config.pop("_name_or_path", None)  # the path again, not the content
        config.pop("transformers_version", None)
        info["hf_config"] = blake3(json.dumps(_jsonable(config), sort_keys=True).encode()).hexdigest()
    info["hf_overrides"] = blake3(json.dumps(_jsonable(getattr(mc, "hf_overrides", None) or {}),
                                             sort_keys=True).encode()).hexdigest()[:16]
    if load_format != "dummy":
        if os.path.isfile(str(mc.model)):  # a single-file checkpoint (GGUF)
            info["weights"] = blake3(_file_digest(Path(str(mc.model)))).hexdigest()
        else:
            root = local_dir(str(mc.model), getattr(mc, "revision", None), getattr(load, "download_dir", None))
            info["weights"] = content_digest(root) if root is not None else ""
    return info


def weights_identified(identity: dict[str, str]) -> bool:
    """``model_identity`` found the weights' content (or they are generated: ``dummy``). When not,
    two different checkpoints under one name would share keys: the integrations then keep the
    model's KV out of the shared pool."""
    return identity.get("load_format") == "dummy" or bool(identity.get("weights"))


def model_digest(vllm_config: Any) -> str:
    """One hex digest of ``model_identity``."""
    return identity_digest(model_identity(vllm_config))


def identity_digest(identity: dict[str, str]) -> str:
    return blake3(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class AdapterIdentities:
    """Content digests of LoRA adapter directories, cached until a file's size or mtime changes.

    Called from the scheduler for every LoRA request: a cached adapter costs a ``stat`` per file
    (adapters have a few); a new or changed one is digested (``content_digest``). Thread-safe.
    """

    def __init__(self, max_entries: int = 256) -> None:
        self._cache: dict[str, tuple[tuple[Any, ...], str]] = {}
        self._lock = threading.Lock()
        self._max = max_entries

    @staticmethod
    def _signature(root: Path) -> tuple[Any, ...]:
        out = []
        for path in _content_files(root):
            st = path.stat()
            out.append((str(path), st.st_size, st.st_mtime_ns))
        return tuple(out)

    def digest(self, path: str) -> str:
        """The adapter's content digest; ``""`` when ``path`` is not a readable directory."""
        root = Path(path)
        try:
            if not root.is_dir():
                return ""
            signature = self._signature(root)
            with self._lock:
                hit = self._cache.get(path)
            if hit is not None and hit[0] == signature:
                return hit[1]
            value = content_digest(root)
        except OSError:
            return ""
        with self._lock:
            if len(self._cache) >= self._max:
                self._cache.pop(next(iter(self._cache)))
            self._cache[path] = (signature, value)
        return value

