"""KV-cache variants compared by the harness: what a full tile (or every token) of K and V
looks like after a round trip through the cache.

Record-based variants go through ``kvarn_ops.reference``: Hadamard rotation (optional),
``encode_records`` into real records of a kvarn-formats layout, ``decode_records``, rotation
back. KIVI-style RTN is the same record path with no normalization (0 iterations: per-channel
K over the tile's tokens, per-token V, fp16 scale and zero point), with and without the
rotation, so it uses exactly the bytes of the KVarN format it is compared with. fp8 is
vLLM's ``fp8_e4m3`` cache with its default scale 1.0, applied to every cached token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

import kvarn_formats as kf
from kvarn_ops.reference import (
    DEFAULT_CONFIG,
    PUBLISHED_CONFIG,
    NormalizeConfig,
    decode_records,
    fields_to_records,
    hadamard,
    quantize_k,
    quantize_v,
)

__all__ = ["METHODS", "CacheVariant", "make_variant", "parse_variant"]

METHODS = {
    "kvarn": DEFAULT_CONFIG,
    "kvarn_iters4": replace(DEFAULT_CONFIG, iters=4),
    "kvarn_nosinkrow": replace(DEFAULT_CONFIG, sink_token=False),
    "kvarn_nosinkkey": replace(DEFAULT_CONFIG, sink_key=False),
    "kvarn_window": replace(DEFAULT_CONFIG, clip_search="window"),
    "kvarn_rtn": NormalizeConfig(),
    "kvarn_mse": NormalizeConfig(rounding="mse_clip"),
    "kvarn_grid": NormalizeConfig(rounding="mse_grid"),
    "kvarn_refit": NormalizeConfig(rounding="rtn_refit"),
    "published": PUBLISHED_CONFIG,
    "published_noclip": replace(PUBLISHED_CONFIG, log_scale_clip=None),
    "kivi": NormalizeConfig(iters=0, prescale=False, rebalance_fp16=False),
    "kivi_h": NormalizeConfig(iters=0, prescale=False, rebalance_fp16=False),
    "kivi_h_mse": NormalizeConfig(iters=0, rounding="mse_clip"),
    "kvarn_mse_v": NormalizeConfig(rounding_v="mse_clip"),
    "kvarn_mse_k": NormalizeConfig(rounding="mse_clip", rounding_v="rtn"),
    "kvarn_refit_v": NormalizeConfig(rounding_v="rtn_refit"),
    "published_ub_v": replace(PUBLISHED_CONFIG, rounding_v="unbiased_clip"),
    # The published clip, made scale invariant by the prescale (bounds relative to the tile max).
    "kvarn_clip_ub_v": NormalizeConfig(log_scale_clip=(-0.3, 10.0), rounding_v="unbiased_clip"),
    "kivi_h_ub_v": NormalizeConfig(iters=0, rounding_v="unbiased_clip"),
    "kvarn_ub": NormalizeConfig(rounding="unbiased_clip"),  # K and V, 8 iterations
    "kvarn_ub_v": NormalizeConfig(rounding_v="unbiased_clip"),
    "kivi_h_ub": NormalizeConfig(iters=0, rounding="unbiased_clip"),
}
"""Method name -> NormalizeConfig of the record path. ``kvarn``: the project's default
quantizer (``DEFAULT_CONFIG``: scale invariant, no clip, 2 normalization iterations, the
clipping search with the unbiased refit for K and V, the sequence's first token's V row kept
almost exact, and at 2-bit K its key on every channel's grid); ``kvarn_iters4``: the same
with 4 iterations (the default until 2026-12-05's evening); the next three are the default
without one of its steps, and follow its iterations (ACCURACY.md measured them at 4, against
the default of the time): ``kvarn_nosinkrow``: without the sink row and key (the default
until 2026-12-05); ``kvarn_nosinkkey``: without the key's grid only (the default of
2026-12-05's first half); ``kvarn_window``: the clipping search over every ratio of its
window at 2 bits too (``clip_search="window"``, the default until 2026-12-05's pattern
search);
``kvarn_ub``: the same with the
published 8 iterations (the default until 2026-12-04, and what the tables of ACCURACY.md
measured before then call ``kvarn``);
``kvarn_rtn``: that 8-iteration normalization with min/max RTN (the default until the
measurements of ACCURACY.md; the methods below also keep 8 iterations); ``kvarn_ub_v``:
unbiased clip for V only; ``kvarn_mse``: ``rounding="mse_clip"``;
``published``: the published algorithm (-0.3 log-scale clip, no prescale, plain fp16 scales);
``kivi``: KIVI-style RTN without rotation; ``kivi_h``: with the Hadamard rotation;
``kvarn_mse_v``/``kvarn_mse_k``: ``mse_clip`` for the V (K) tiles only. A method maps to one
NormalizeConfig, or to a (K config, V config) pair. Every record method except ``kivi`` is
rotated."""

_FP8_MAX = 448.0


@dataclass(frozen=True)
class CacheVariant:
    """One KV-cache configuration.

    Attributes
    ----------
    name : label used in reports, e.g. ``kvarn_mse/kvarn_k4v2_g64+sink``.
    method : ``"exact"``, ``"fp8"`` or a key of :data:`METHODS`.
    fmt : kvarn-formats dense format name (record methods), else ``None``.
    sink : keep the first tile (G tokens) exact.
    parts : ``"kv"``, ``"k"`` (only K quantized) or ``"v"`` (only V quantized).
    """

    name: str
    method: str
    fmt: str | None = None
    sink: bool = False
    parts: str = "kv"
    group: int = 64
    config: NormalizeConfig | tuple | None = field(default=None, compare=False)

    @property
    def per_token(self) -> bool:
        """Every cached token is quantized (no exact current tile), as vLLM's fp8 cache."""
        return self.method == "fp8"

    @property
    def exact(self) -> bool:
        return self.method == "exact"

    def bits_per_element(self, head_dim: int) -> float:
        """Cache bits per K or V element (record bytes over 2*G*D elements; 8 for fp8)."""
        if self.exact:
            return 32.0
        if self.per_token:
            return 8.0
        assert self.fmt is not None
        lay = kf.dense_layout(self.fmt, head_dim)
        return lay.record_bytes * 8.0 / (2 * lay.block_size * head_dim)

    def roundtrip(
        self, k: torch.Tensor, v: torch.Tensor, sink_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``(k, v)`` of tiles ``[N, G, D]`` (model frame, float32); for per-token
        variants any ``[..., D]``. Parts not quantized are returned unchanged. ``sink_rows``
        (int [N], -1 for none): each tile's attention-sink token, as a serving engine marks
        it (the first token of the sequence), used by configs with ``sink_token``."""
        if self.exact:
            return k, v
        if self.per_token:
            kq = k.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(k.dtype)
            vq = v.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(v.dtype)
        else:
            assert self.fmt is not None
            lay = kf.dense_layout(self.fmt, k.shape[-1])
            rot = self.method != "kivi"
            kr = hadamard(k) if rot else k.float()
            vr = hadamard(v) if rot else v.float()
            kcfg, vcfg = self.config if isinstance(self.config, tuple) else (self.config,) * 2
            fields = quantize_k(kr, int(lay.field("k_codes").bits or 0), kcfg, sink_rows)
            fields.update(quantize_v(vr, int(lay.field("v_codes").bits or 0), vcfg, sink_rows))
            rec = fields_to_records(fields, lay)  # the bytes encode_records writes
            kq, vq = decode_records(rec, lay)
            if rot:
                kq, vq = hadamard(kq), hadamard(vq)
        return (kq if "k" in self.parts else k), (vq if "v" in self.parts else v)


def make_variant(
    method: str, fmt: str | None = None, sink: bool = False, parts: str = "kv"
) -> CacheVariant:
    """Build a variant; ``fmt`` is required for record methods."""
    if method in ("exact", "fp8"):
        name = method
        group = 64
        config = None
    elif method in METHODS:
        if fmt is None:
            raise ValueError(f"method {method!r} needs a kvarn format, e.g. kvarn_k4v2_g64")
        parsed = kf.parse_format(fmt)
        if not isinstance(parsed, kf.DenseFormat):
            raise ValueError(f"format {fmt!r}: only dense kvarn formats are supported here")
        name = f"{method}/{fmt}"
        group = parsed.group
        config = METHODS[method]
    else:
        raise ValueError(
            f"unknown method {method!r}: expected exact, fp8 or one of {sorted(METHODS)}"
        )
    if parts not in ("kv", "k", "v"):
        raise ValueError(f"parts: must be 'kv', 'k' or 'v', got {parts!r}")
    if sink:
        name += "+sink"
    if parts != "kv":
        name += f"[{parts} only]"
    return CacheVariant(name, method, fmt, sink, parts, group, config)


def parse_variant(spec: str) -> CacheVariant:
    """``"method[/format][+sink]"``, e.g. ``"kvarn_mse/kvarn_k4v2_g64+sink"``, ``"fp8"``."""
    sink = spec.endswith("+sink")
    body = spec[: -len("+sink")] if sink else spec
    method, _, fmt = body.partition("/")
    return make_variant(method, fmt or None, sink)
