"""Checks of ``kvarn-eval run`` options and inputs, before any model is loaded: each problem
is one message naming the option, so the command stops with a usage error instead of a
traceback or a silently smaller (or empty) measurement."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["check_run_args", "check_texts", "load_text_ids", "read_json"]


def _dense_group(fmt: str) -> int:
    import kvarn_formats as kf

    parsed = kf.parse_format(fmt)  # FormatError (a ValueError) names the problem
    if not isinstance(parsed, kf.DenseFormat):
        raise ValueError(f"{fmt}: only dense kvarn formats are evaluated here")
    return parsed.group


def check_run_args(args: argparse.Namespace, default_detail: str = "") -> str | None:
    """The first problem of the ``run`` options, or None; sets ``args.group`` to the formats'
    tile size when it was not given. ``--detail`` entries are checked when they are not the
    default list (which names variants of the default run)."""
    from kvarn_ops.evaluation.variants import METHODS

    for name in ("threads", "tokens", "gen_prompt", "static_queries"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}"
    if args.gen_tokens < 0:
        return f"--gen-tokens: must be >= 0 (0 skips generation), got {args.gen_tokens}"
    methods = [m for m in args.methods.split(",") if m]
    if not methods:
        return "--methods: no method given"
    for m in methods:
        if m != "fp8" and m not in METHODS:
            return f"--methods: unknown method {m!r}; expected fp8 or one of {sorted(METHODS)}"
    groups = set()
    if any(m != "fp8" for m in methods):
        formats = [f for f in args.formats.split(",") if f]
        if not formats:
            return "--formats: no format given for the record methods"
        for f in formats:
            try:
                groups.add(_dense_group(f))
            except ValueError as exc:
                return f"--formats: {exc}"
    if args.group is None:
        if len(groups) > 1:
            return f"--formats: tile sizes {sorted(groups)} mixed; run each size separately"
        args.group = groups.pop() if groups else 64
    elif args.group < 1:
        return f"--group: must be at least 1, got {args.group}"
    elif groups and groups != {args.group}:
        return f"--group {args.group}: the formats' tiles are {sorted(groups)} tokens"
    if args.model != "smollm2" and not Path(args.model).is_dir():
        return f"--model {args.model}: no such directory (or 'smollm2')"
    if args.detail not in ("all", "none", default_detail):
        keys = {"fp8"} | {f"{m}/{f}" for m in methods for f in args.formats.split(",")}
        for d in args.detail.split(","):
            if d and d not in keys:
                return f"--detail: {d!r} is no variant of this run (method/format, fp8, all, none)"
    return None


def read_json(path: str, where: str) -> object:
    """The JSON document of ``path``; ValueError starting with ``where`` when the file cannot
    be read or is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None


def load_text_ids(path: str) -> tuple[list[list[int]], str]:
    """Texts of a ``--text-ids`` file: ``{"ids": [...]}`` or ``{"texts": [[...], ...]}``,
    token ids as JSON integers >= 0. Raises ValueError naming the problem."""
    where = f"--text-ids {path}"
    data = read_json(path, where)
    if not isinstance(data, dict) or ("ids" in data) == ("texts" in data):
        raise ValueError(f"{where}: expected an object with 'ids' or 'texts' (one of them)")
    texts = data["texts"] if "texts" in data else [data["ids"]]
    if not isinstance(texts, list) or not texts:
        raise ValueError(f"{where}: no texts")
    for i, t in enumerate(texts):
        if not isinstance(t, list) or not t:
            raise ValueError(f"{where}: text {i} is not a non-empty list of token ids")
        bad = next((x for x in t if not isinstance(x, int) or isinstance(x, bool) or x < 0), None)
        if bad is not None:
            raise ValueError(f"{where}: text {i} holds {bad!r}, not a token id (an integer >= 0)")
    return texts, str(data.get("source", path))


def check_texts(texts: list[list[int]], tokens: int, group: int, sink: str) -> str | None:
    """Every text long enough for ``--tokens`` and for at least one quantized tile (two with
    the first tile exact). Ids outside the vocabulary are refused by ``Harness``, which knows
    the model."""
    for i, t in enumerate(texts):
        if len(t) < tokens:
            return f"--tokens {tokens}: text {i} has only {len(t)} tokens"
    need = (2 if sink in ("on", "both") else 1) * group + 1
    if tokens < need:
        return (
            f"--tokens {tokens}: at least {need} are needed so that a tile of {group} tokens is "
            "quantized and followed by a query"
            + (" (the first tile is exact)" if need > group + 1 else "")
        )
    return None
