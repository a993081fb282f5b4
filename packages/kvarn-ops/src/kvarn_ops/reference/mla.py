"""MLA (latent-cache) ops in plain torch: exact-pool scatter, pack, rehydrate, materialize,
index remap, fp8 staging and decode.

The cache of one MLA layer (docs/contracts.md, "kvarn-ops: the MLA cache"):

- ``packed`` uint8 ``[num_blocks, R]``, ``R = layout.record_bytes`` of
  ``kvarn_formats.mla_layout("kvarn_mla_k{b}_g64")``: one record per physical block of 64
  tokens, latent in the rotated frame (``latent @ H_512``), RoPE as bf16.
- exact pool: ``pool_latent`` ``[P, 64, 512]`` bfloat16 or float8_e4m3fn (rotated frame),
  ``pool_scale`` float32 ``[P, 64]`` for an fp8 pool (value = fp8 * scale, scale = amax over the
  token's 512 values / 448, 1.0 when amax is 0), else ``None``; ``pool_rope`` bfloat16
  ``[P, 64, 64]``. Pool slot = ``pool_block * 64 + offset``.
- ``block_pool_map`` int32 ``[num_blocks]``: ``-1`` when physical block ``b`` is read from its
  packed record, else the pool block holding its exact rows (the block still filling, sinks,
  rehydrated blocks). A physical slot (vLLM's slot mapping) is ``b * 64 + offset``.

The MLA K tile is the dense K orientation: ``[512 channels, 64 tokens]``, RTN per channel over
the tile's tokens, so packing reuses :func:`kvarn_ops.reference.quantize.quantize_k` and
unpacking :func:`kvarn_ops.reference.quantize.dequantize_k` unchanged.

Memory traffic (T tokens, E pool latent bytes per value, s = 4 if fp8 else 0):

- ``mla_exact_scatter``: read ``T*(512*e_in + 64*e_rope) + 8T``, write ``T*(512*E + s + 128)``.
- ``mla_pack``: read ``N*64*(512*E + s + 128) + 8N``, write ``N*R``.
- ``mla_rehydrate``: read ``N*R + 8N``, write ``N*64*(512*E + s + 128)``.
- ``mla_materialize``: read per token ``512*b/8 + 128`` plus its block's scales
  (``2*1024 + 2``) for packed tokens or ``512*E + s + 128`` for pool tokens, ``8 + 4`` index
  bytes; write ``1152`` bytes per token.
- ``mla_stage_fp8``: reads as ``mla_materialize``; writes ``656`` bytes per token.
- ``mla_decode``: reads every cached token once (``R/64`` bytes per packed token, ``512*E + s
  + 128`` per pool token) plus ``q`` and writes ``out``; split-K partials ``B*H*S*(512+1)*4``
  written and read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvarn_formats as kf
from kvarn_ops._validate import (
    FP8_MAX,
    MODEL_DTYPES,
    check_count,
    check_index_range,
    check_softmax_scale,
    check_tensor,
)
from kvarn_ops.reference.bitpack import pack_codes, unpack_codes
from kvarn_ops.reference.hadamard import hadamard
from kvarn_ops.reference.quantize import NormalizeConfig, dequantize_k, quantize_k

__all__ = [
    "MLA_CONFIG",
    "GROUP",
    "LATENT_DIM",
    "MLA_DIM",
    "POOL_LATENT_DTYPES",
    "ROPE_DIM",
    "STAGED_BYTES",
    "MlaDecodeWorkspace",
    "check_mla_layout",
    "check_mla_pool",
    "check_remap_args",
    "decode_mla_records",
    "encode_mla_records",
    "mla_decode",
    "mla_decode_workspace",
    "mla_exact_scatter",
    "mla_materialize",
    "mla_pack",
    "mla_rehydrate",
    "mla_remap_indices",
    "mla_stage_fp8",
    "read_pool_latent",
    "read_tokens",
    "refit_affine",
    "stage_records_from_latent",
]

MLA_CONFIG = NormalizeConfig()
"""The MLA pack's quantizer: the dense default's normalization with min/max RTN. The dense
formats moved to the clipping search with the unbiased refit after measuring it on a real
model; no real MLA model runs offline here to measure it on latents, so MLA keeps RTN."""

LATENT_DIM = 512
ROPE_DIM = 64
MLA_DIM = LATENT_DIM + ROPE_DIM
GROUP = 64
STAGED_BYTES = 656
POOL_LATENT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# argument checks


def check_mla_layout(name: str, layout: object) -> None:
    """``layout`` must be ``kvarn_formats.mla_layout("kvarn_mla_k{b}_g64")``."""
    kind = getattr(layout, "kind", None)
    if not isinstance(layout, kf.RecordLayout):
        raise ValueError(
            f"{name}: expected a kvarn_formats.RecordLayout from kvarn_formats.mla_layout(...), "
            f"got {type(layout).__name__}"
        )
    if kind != "mla":
        raise ValueError(
            f"{name}: format {layout.format_name!r} is a {kind} layout; MLA ops need "
            "kvarn_formats.mla_layout('kvarn_mla_k{b}_g64')"
        )
    if layout.block_size != GROUP or layout.head_dim != LATENT_DIM or layout.rope_dim != ROPE_DIM:
        raise ValueError(
            f"{name}: MLA ops support 64-token tiles of a 512 latent + 64 RoPE, got "
            f"{layout.format_name!r} (block {layout.block_size}, latent {layout.head_dim}, "
            f"rope {layout.rope_dim})"
        )


def check_mla_pool(pool_latent, pool_scale, pool_rope, *, device=None) -> int:
    """Check the exact pool; return its number of pool blocks P."""
    check_tensor("pool_latent", pool_latent, dtypes=POOL_LATENT_DTYPES, ndim=3, device=device)
    p = pool_latent.shape[0]
    check_tensor("pool_latent", pool_latent, shape=(p, GROUP, LATENT_DIM))
    dev = pool_latent.device
    check_tensor(
        "pool_rope", pool_rope, dtypes=torch.bfloat16, shape=(p, GROUP, ROPE_DIM), device=dev
    )
    if pool_latent.dtype == torch.float8_e4m3fn:
        if pool_scale is None:
            raise ValueError(
                f"pool_scale: the pool latent is float8_e4m3fn, so a float32 [{p}, {GROUP}] "
                "per-token scale tensor is required"
            )
        check_tensor("pool_scale", pool_scale, dtypes=torch.float32, shape=(p, GROUP), device=dev)
    elif pool_scale is not None:
        raise ValueError("pool_scale: must be None for a bfloat16 pool (only fp8 pools scale)")
    return p


def check_packed(packed, layout, *, device) -> int:
    """Check ``packed`` uint8 ``[num_blocks, R]``; return num_blocks."""
    check_mla_layout("layout", layout)
    check_tensor("packed", packed, dtypes=torch.uint8, ndim=2, device=device)
    if packed.shape[1] != layout.record_bytes:
        raise ValueError(
            f"packed: record stride must be {layout.record_bytes} bytes for "
            f"{layout.format_name!r}, got {packed.shape[1]}"
        )
    return packed.shape[0]


def _check_block_pool_map(block_pool_map, nb: int, p: int, device) -> None:
    check_tensor("block_pool_map", block_pool_map, dtypes=torch.int32, shape=(nb,), device=device)
    check_index_range("block_pool_map", block_pool_map, p, sentinel=-1)


# ---------------------------------------------------------------------------------------------
# element conversions shared by the ops


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def quantize_pool_latent(x: torch.Tensor, dtype: torch.dtype):
    """Round rotated latents ``x [..., 512]`` (fp32) to the pool dtype; ``(values, scale)``.

    fp8: ``scale = amax / 448`` per token (1.0 when amax is 0), ``values = clamp(x / scale,
    -448, 448)`` rounded to nearest even e4m3. bf16: ``values = x`` rounded, ``scale = None``.
    A token holding NaN/Inf stays non-finite (fp8: scale 1.0 when it holds NaN, inf when it
    holds an infinity), so the pack quantizes it as zeros.
    """
    if dtype == torch.bfloat16:
        return x.to(torch.bfloat16), None
    amax = x.abs().amax(dim=-1)
    # Tensor / tensor: a correctly rounded division on every device (CUDA turns division by
    # a Python scalar into a multiplication by its reciprocal, one bit off half the time).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    vals = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return vals, scale


def read_pool_latent(pool_latent, pool_scale, blocks: torch.Tensor) -> torch.Tensor:
    """Pool blocks ``blocks [N]`` as float32 ``[N, 64, 512]`` (rotated frame)."""
    idx = blocks.to(torch.long)
    vals = _bits(pool_latent)[idx].view(pool_latent.dtype).to(torch.float32)
    if pool_scale is not None:
        vals = vals * pool_scale[idx][..., None]
    return vals


# ---------------------------------------------------------------------------------------------
# records


def refit_affine(x: torch.Tensor, fields: dict) -> dict:
    """Weighted least-squares refit of each channel's ``(col_scale, zero_point)`` given the
    codes and the token scales: minimizes ``sum_t (x[d, t] - (c*a + z) * r[t])**2`` per ``d``.

    ``x`` float32 ``[N, 512, 64]`` (K orientation); ``fields`` as from ``quantize_k``. Returns
    new fields (float16 scales); a channel keeps its RTN scales when the refit is singular or
    does not lower its error after fp16 rounding.
    """
    c = fields["k_codes"].to(torch.float64)
    r = fields["k_row_scale"].to(torch.float64)[:, None, :]
    xd = x.to(torch.float64)
    u, w = c * r, r.expand_as(c)  # x ~ a*u + z*w
    suu, suw, sww = (u * u).sum(-1), (u * w).sum(-1), (w * w).sum(-1)
    sxu, sxw = (xd * u).sum(-1), (xd * w).sum(-1)
    det = suu * sww - suw * suw
    ok = det.abs() > 1e-12 * (suu * sww).clamp_min(1e-300)
    safe = torch.where(ok, det, torch.ones_like(det))
    a = torch.where(ok, (sxu * sww - sxw * suw) / safe, 0.0).to(torch.float16)
    z = torch.where(ok, (sxw * suu - sxu * suw) / safe, 0.0).to(torch.float16)
    a0, z0 = fields["k_col_scale"], fields["k_zero_point"]

    def err(aa, zz):
        rec = (c * aa.to(torch.float64)[..., None] + zz.to(torch.float64)[..., None]) * r
        return ((xd - rec) ** 2).sum(-1)

    better = ok & torch.isfinite(a) & torch.isfinite(z) & (err(a, z) < err(a0, z0))
    out = dict(fields)
    out["k_col_scale"] = torch.where(better, a, a0)
    out["k_zero_point"] = torch.where(better, z, z0)
    return out


def encode_mla_records(
    latent: torch.Tensor, rope: torch.Tensor, layout, *, refit: bool = False
) -> torch.Tensor:
    """Quantize N latent tiles into MLA records.

    Parameters
    ----------
    latent : float32 [N, 64, 512], rotated frame, token-major. A token holding NaN/Inf is
        quantized as zeros (as in ``quantize_k``).
    rope : bfloat16 [N, 64, 64], copied as is.
    layout : MLA layout. refit : see :func:`refit_affine` (off in every op; see tests).

    Returns
    -------
    uint8 [N, R]; bytes between fields (none for the g64 layouts) are zero.
    """
    check_mla_layout("layout", layout)
    n = latent.shape[0]
    bits = layout.field("codes").bits
    fields = quantize_k(latent.to(torch.float32), bits, MLA_CONFIG)
    if refit:
        tiles = torch.nan_to_num(latent.to(torch.float32)).transpose(1, 2)
        fields = refit_affine(tiles, fields)
    out = torch.zeros(n, layout.record_bytes, dtype=torch.uint8, device=latent.device)
    parts = {
        "codes": pack_codes(fields["k_codes"].reshape(n, -1), bits),
        "col_scale": fields["k_col_scale"].contiguous().view(torch.uint8),
        "zero_point": fields["k_zero_point"].contiguous().view(torch.uint8),
        "row_scale": fields["k_row_scale"].contiguous().view(torch.uint8),
        "rope": rope.to(torch.bfloat16).reshape(n, -1).contiguous().view(torch.uint8),
    }
    for name, data in parts.items():
        f = layout.field(name)
        out[:, f.offset : f.end] = data
    return out


def record_tensors(records: torch.Tensor, layout) -> dict:
    """Fields of MLA records ``[N, R]``: ``codes`` uint8 [N, 512, 64], ``col_scale``,
    ``zero_point`` float16 [N, 512], ``row_scale`` float16 [N, 64], ``rope`` bf16 [N, 64, 64]."""
    n = records.shape[0]
    out = {}
    for f in layout.fields:
        raw = records[:, f.offset : f.end]
        if f.dtype == "codes":
            out[f.name] = unpack_codes(raw, f.bits, f.count).view(n, *f.shape)
        else:
            dt = torch.float16 if f.dtype == "float16" else torch.bfloat16
            out[f.name] = raw.contiguous().view(dt).view(n, *f.shape)
    return out


def decode_mla_records(records: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize MLA records ``[N, R]``: ``(latent float32 [N, 64, 512] rotated frame,
    rope bfloat16 [N, 64, 64])``; ``latent[t, d] = (code*col_scale[d] + zp[d]) * row_scale[t]``
    with each product and sum rounded to fp32 (exact: code*col_scale fits in fp32)."""
    f = record_tensors(records, layout)
    lat = dequantize_k(
        {
            "k_codes": f["codes"],
            "k_col_scale": f["col_scale"],
            "k_zero_point": f["zero_point"],
            "k_row_scale": f["row_scale"],
        }
    )
    return lat, f["rope"]


# ---------------------------------------------------------------------------------------------
# ops


def check_scatter_args(latent, rope, slots, pool_latent, pool_rope, pool_scale) -> None:
    """The argument checks of ``mla_exact_scatter`` (this reference and the Triton kernel):
    ValueError naming the bad argument."""
    p = check_mla_pool(pool_latent, pool_scale, pool_rope)
    dev = pool_latent.device
    check_tensor("latent", latent, dtypes=MODEL_DTYPES, ndim=2, device=dev)
    t = latent.shape[0]
    check_tensor("latent", latent, shape=(t, LATENT_DIM))
    check_tensor("rope", rope, dtypes=MODEL_DTYPES, shape=(t, ROPE_DIM), device=dev)
    check_tensor("slots", slots, dtypes=torch.int64, shape=(t,), device=dev)
    check_index_range("slots", slots, p * GROUP, sentinel=-1)


def mla_exact_scatter(latent, rope, slots, pool_latent, pool_rope, pool_scale=None) -> None:
    """Rotate new tokens' latents by ``H_512`` and write them with their RoPE into the pool.

    Parameters
    ----------
    latent : [T, 512] float16/bfloat16/float32, model frame.
    rope : [T, 64] float16/bfloat16/float32 (stored as bf16).
    slots : int64 [T]; token i goes to pool block ``slots[i] // 64``, row ``slots[i] % 64``;
        ``-1`` skips the token. Duplicate slots: which token lands is unspecified.
    pool_latent, pool_rope, pool_scale : the exact pool (written at those rows only).
    """
    check_scatter_args(latent, rope, slots, pool_latent, pool_rope, pool_scale)
    sel = slots >= 0
    blk, off = slots[sel] // GROUP, slots[sel] % GROUP
    vals, scale = quantize_pool_latent(hadamard(latent[sel]), pool_latent.dtype)
    _bits(pool_latent)[blk, off] = _bits(vals)
    if scale is not None:
        pool_scale[blk, off] = scale
    pool_rope[blk, off] = rope[sel].to(torch.bfloat16)


def _check_block_pairs(
    src, dst, src_high: int, dst_high: int, src_name: str, dst_name: str, device
) -> int:
    check_tensor(src_name, src, dtypes=torch.int32, ndim=1, device=device)
    n = src.shape[0]
    check_tensor(dst_name, dst, dtypes=torch.int32, shape=(n,), device=device)
    check_index_range(src_name, src, src_high)
    check_index_range(dst_name, dst, dst_high)
    return n


def mla_pack(
    pool_latent,
    pool_scale,
    pool_rope,
    src_pool_blocks,
    dst_blocks,
    packed,
    layout,
    *,
    refit: bool = False,
) -> None:
    """Pack N full pool blocks: ``packed[dst_blocks[i]] = record of pool block
    src_pool_blocks[i]`` (normalize + RTN + fold + bit-pack the [512, 64] latent tile, RoPE
    copied as bf16).

    Parameters
    ----------
    pool_latent, pool_scale, pool_rope : the exact pool (read).
    src_pool_blocks, dst_blocks : int32 [N].
    packed : uint8 [num_blocks, R] (written at ``dst_blocks`` only, every byte of each).
    layout : MLA layout. refit : weighted least-squares refit (reference only; off by default).
    """
    p = check_mla_pool(pool_latent, pool_scale, pool_rope)
    dev = pool_latent.device
    nb = check_packed(packed, layout, device=dev)
    n = _check_block_pairs(src_pool_blocks, dst_blocks, p, nb, "src_pool_blocks", "dst_blocks", dev)
    if n == 0:
        return
    lat = read_pool_latent(pool_latent, pool_scale, src_pool_blocks)
    rope = pool_rope[src_pool_blocks.to(torch.long)]
    packed[dst_blocks.to(torch.long)] = encode_mla_records(lat, rope, layout, refit=refit)


def mla_rehydrate(
    packed, src_blocks, dst_pool_blocks, pool_latent, pool_scale, pool_rope, layout
) -> None:
    """Inverse of pack: write the dequantized rows of record ``src_blocks[i]`` (rounded to the
    pool dtype as ``mla_exact_scatter`` does, rotated frame) and its RoPE into pool block
    ``dst_pool_blocks[i]`` (all 64 rows)."""
    p = check_mla_pool(pool_latent, pool_scale, pool_rope)
    dev = pool_latent.device
    nb = check_packed(packed, layout, device=dev)
    n = _check_block_pairs(src_blocks, dst_pool_blocks, nb, p, "src_blocks", "dst_pool_blocks", dev)
    if n == 0:
        return
    lat, rope = decode_mla_records(packed[src_blocks.to(torch.long)], layout)
    vals, scale = quantize_pool_latent(lat, pool_latent.dtype)
    dst = dst_pool_blocks.to(torch.long)
    _bits(pool_latent)[dst] = _bits(vals)
    if scale is not None:
        pool_scale[dst] = scale
    pool_rope[dst] = rope


def check_remap_args(indices, req_ids, block_table, out) -> tuple[int, int]:
    """The argument checks of ``mla_remap_indices`` (this reference and the Triton kernel):
    ValueError naming the bad argument. Returns ``(T, K)``."""
    dev = indices.device
    check_tensor("indices", indices, dtypes=torch.int32, ndim=2, device=dev)
    t, k = indices.shape
    check_tensor("req_ids", req_ids, dtypes=torch.int32, shape=(t,), device=dev)
    check_tensor("block_table", block_table, dtypes=torch.int32, ndim=2, device=dev)
    check_tensor("out", out, dtypes=torch.int64, shape=(t, k), device=dev)
    b, mb = block_table.shape
    check_index_range("req_ids", req_ids, b)
    check_index_range("indices", indices, mb * GROUP, low=-1)
    return t, k


def mla_remap_indices(indices, req_ids, block_table, out) -> None:
    """Logical token indices to physical slots: ``out[i, j] = block_table[r, idx // 64] * 64 +
    idx % 64`` with ``r = req_ids[i]``, ``idx = indices[i, j]``; ``idx < 0`` gives ``-1``.

    Parameters
    ----------
    indices : int32 [T, K] (top-k selections, -1 padded).
    req_ids : int32 [T], request row of each query token in ``block_table``.
    block_table : int32 [B, max_blocks].
    out : int64 [T, K] (written).
    """
    check_remap_args(indices, req_ids, block_table, out)
    idx = indices.to(torch.long)
    phys = block_table[req_ids.to(torch.long)[:, None], (idx.clamp_min(0) // GROUP)]
    out.copy_(torch.where(idx >= 0, phys.to(torch.long) * GROUP + idx.clamp_min(0) % GROUP, -1))


def read_tokens(packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout):
    """Tokens at physical ``slots [N]`` (all valid): ``(latent float32 [N, 512] rotated frame,
    rope bfloat16 [N, 64])``, from the pool when the block is mapped there, else the record."""
    blk = (slots // GROUP).to(torch.long)
    off = slots % GROUP
    pb = block_pool_map[blk].to(torch.long)
    n = slots.shape[0]
    lat = torch.empty(n, LATENT_DIM, dtype=torch.float32, device=slots.device)
    rope = torch.empty(n, ROPE_DIM, dtype=torch.bfloat16, device=slots.device)
    in_pool = pb >= 0
    if bool(in_pool.any()):
        pl = read_pool_latent(pool_latent, pool_scale, pb[in_pool])  # [n', 64, 512]
        rows = torch.arange(pl.shape[0], device=slots.device)
        lat[in_pool] = pl[rows, off[in_pool]]
        rope[in_pool] = pool_rope[pb[in_pool], off[in_pool]]
    rec = ~in_pool
    if bool(rec.any()):
        ub, inv = torch.unique(blk[rec], return_inverse=True)
        tl_, tr = decode_mla_records(packed[ub], layout)
        lat[rec] = tl_[inv, off[rec]]
        rope[rec] = tr[inv, off[rec]]
    return lat, rope


def _check_gather(packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout):
    p = check_mla_pool(pool_latent, pool_scale, pool_rope)
    dev = pool_latent.device
    nb = check_packed(packed, layout, device=dev)
    _check_block_pool_map(block_pool_map, nb, p, dev)
    check_tensor("slots", slots, dtypes=torch.int64, ndim=1, device=dev)
    check_index_range("slots", slots, nb * GROUP, sentinel=-1)
    return slots.shape[0]


def mla_materialize(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout, out
) -> None:
    """Gather tokens into bf16 ``[N, 576]``: ``out[i, :512]`` = latent of physical slot
    ``slots[i]`` in the model frame (dequantized, rotated back by ``H_512``), ``out[i, 512:]`` its
    RoPE. ``slots[i] == -1`` leaves row i untouched.

    Parameters
    ----------
    slots : int64 [N] physical slots (``block * 64 + offset``) or -1.
    out : bfloat16 [N, 576], contiguous.
    """
    n = _check_gather(packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout)
    check_tensor("out", out, dtypes=torch.bfloat16, shape=(n, MLA_DIM), device=packed.device)
    ok = slots >= 0
    if not bool(ok.any()):
        return
    lat, rope = read_tokens(
        packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots[ok], layout
    )
    out[ok] = torch.cat((hadamard(lat).to(torch.bfloat16), rope), dim=1)


def stage_records_from_latent(lat: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Staged fp8 records ``uint8 [N, 656]`` from float32 latents ``[N, 512]`` and bf16 RoPE:
    latent rounded to bf16, per 128 dims ``scale = amax / 448`` (1.0 when amax is 0),
    ``e4m3(clamp(x / scale, -448, 448))`` rounded to nearest even."""
    n = lat.shape[0]
    x = lat.to(torch.bfloat16).to(torch.float32).view(n, 4, 128)
    amax = x.abs().amax(-1)
    # Tensor / tensor: a correctly rounded division on every device (CUDA turns division by
    # a Python scalar into a multiplication by its reciprocal, one bit off half the time).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat(
        (
            q.view(n, 512).view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            rope.contiguous().view(torch.uint8),
        ),
        dim=1,
    )


def mla_stage_fp8(
    packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout, out
) -> None:
    """Gather tokens into 656-byte staged fp8 records (``kvarn_formats.STAGED_MLA_FP8``).

    The latent stays in the rotated frame (the consumer rotates its absorbed query latent by
    ``H_512`` and its output back, as ``mla_decode`` does): staging is then a pure dequantize
    and is byte-exact. ``slots[i] == -1`` leaves ``out[i]`` untouched.

    Parameters
    ----------
    slots : int64 [N] physical slots or -1.
    out : uint8 [N, 656], contiguous.
    """
    n = _check_gather(packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots, layout)
    check_tensor("out", out, dtypes=torch.uint8, shape=(n, STAGED_BYTES), device=packed.device)
    ok = slots >= 0
    if not bool(ok.any()):
        return
    lat, rope = read_tokens(
        packed, block_pool_map, pool_latent, pool_scale, pool_rope, slots[ok], layout
    )
    out[ok] = stage_records_from_latent(lat, rope)


# ---------------------------------------------------------------------------------------------
# decode


@dataclass
class MlaDecodeWorkspace:
    """Scratch of ``mla_decode`` (allocated once, outside the hot path).

    q_rot float32 [B, H, 512]; part_out float32 [B, H, S, 512]; part_lse float32 [B, H, S].
    """

    q_rot: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor

    @property
    def num_splits(self) -> int:
        return self.part_lse.shape[2]


def mla_decode_workspace(
    batch: int, num_heads: int, num_splits: int = 32, device=None
) -> MlaDecodeWorkspace:
    """Workspace for ``mla_decode`` with ``num_splits`` split-K partitions per request."""
    check_count("batch", batch)
    check_count("num_heads", num_heads)
    check_count("num_splits", num_splits, 1)
    f32 = torch.float32
    return MlaDecodeWorkspace(
        q_rot=torch.empty(batch, num_heads, LATENT_DIM, dtype=f32, device=device),
        part_out=torch.empty(batch, num_heads, num_splits, LATENT_DIM, dtype=f32, device=device),
        part_lse=torch.empty(batch, num_heads, num_splits, dtype=f32, device=device),
    )


def check_decode_args(
    q,
    packed,
    block_table,
    seq_lens,
    block_pool_map,
    pool_latent,
    pool_scale,
    pool_rope,
    layout,
    out,
    workspace,
    indices,
    softmax_scale,
):
    """Shared checks of the decode reference and launcher; returns ``(B, H)``."""
    check_softmax_scale(softmax_scale)
    p = check_mla_pool(pool_latent, pool_scale, pool_rope)
    dev = pool_latent.device
    nb = check_packed(packed, layout, device=dev)
    _check_block_pool_map(block_pool_map, nb, p, dev)
    check_tensor("q", q, dtypes=MODEL_DTYPES, ndim=3, device=dev)
    b, h, dq = q.shape
    if dq != MLA_DIM:
        raise ValueError(f"q: last dim must be {MLA_DIM} (512 latent + 64 RoPE), got {dq}")
    check_tensor("block_table", block_table, dtypes=torch.int32, ndim=2, device=dev)
    if block_table.shape[0] != b:
        raise ValueError(
            f"block_table: expected {b} rows (one per request), got {block_table.shape[0]}"
        )
    mb = block_table.shape[1]
    check_tensor("seq_lens", seq_lens, dtypes=torch.int32, shape=(b,), device=dev)
    check_tensor("out", out, dtypes=MODEL_DTYPES, shape=(b, h, LATENT_DIM), device=dev)
    if workspace is not None and not isinstance(workspace, MlaDecodeWorkspace):
        raise ValueError(
            f"workspace: must be an MlaDecodeWorkspace (mla_decode_workspace(...)) or None, got "
            f"{type(workspace).__name__}"
        )
    if workspace is not None:
        s = workspace.part_lse.shape[2] if workspace.part_lse.dim() == 3 else 0
        check_tensor(
            "workspace.q_rot",
            workspace.q_rot,
            dtypes=torch.float32,
            shape=(b, h, LATENT_DIM),
            device=dev,
        )
        check_tensor(
            "workspace.part_out",
            workspace.part_out,
            dtypes=torch.float32,
            shape=(b, h, s, LATENT_DIM),
            device=dev,
        )
        check_tensor(
            "workspace.part_lse",
            workspace.part_lse,
            dtypes=torch.float32,
            shape=(b, h, s),
            device=dev,
        )
        if s < 1:
            raise ValueError("workspace: needs at least one split")
    if seq_lens.device.type == "cpu" and b:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 1:
            raise ValueError(f"seq_lens: every entry must be >= 1, found {lo}")
        if -(-hi // GROUP) > mb:
            raise ValueError(
                f"seq_lens: a length of {hi} tokens needs {-(-hi // GROUP)} blocks, "
                f"but block_table has {mb} columns"
            )
        used = torch.arange(mb)[None, :] < (-(-seq_lens // GROUP))[:, None]
        check_index_range("block_table", block_table, nb, used=used)
    if indices is not None:
        check_tensor("indices", indices, dtypes=torch.int32, ndim=2, device=dev)
        if indices.shape[0] != b:
            raise ValueError(f"indices: expected {b} rows, got {indices.shape[0]}")
        if indices.device.type == "cpu" and b:
            bad = (indices >= seq_lens[:, None]) | (indices < -1)
            if bool(bad.any()):
                raise ValueError("indices: entries must be -1 or in [0, seq_lens[b])")
    return b, h


def mla_decode(
    q,
    packed,
    block_table,
    seq_lens,
    block_pool_map,
    pool_latent,
    pool_scale,
    pool_rope,
    layout,
    softmax_scale: float,
    out,
    workspace=None,
    indices=None,
) -> None:
    """MLA decode with absorbed queries over packed tiles and exact-pool rows.

    ``out[b, h] = sum_t p[b, h, t] * latent[t]`` (model frame), ``p = softmax(softmax_scale *
    (q[b, h, :512] . latent[t] + q[b, h, 512:] . rope[t]))`` over the tokens ``t < seq_lens[b]``
    of request b (logical block ``i`` at physical block ``block_table[b, i]``, read from the
    pool when ``block_pool_map`` maps it, else from its record), or over ``indices[b]`` (logical
    indices, ``-1`` ignored) when given. A request whose selection is empty gets zeros.
    Computed in float64 (the oracle); the latent dot runs in the rotated frame and the result is
    rotated back, which is the identity up to rounding.

    Parameters
    ----------
    q : [B, H, 576] float16/bfloat16/float32, model frame.
    block_table : int32 [B, max_blocks]; seq_lens : int32 [B] (>= 1).
    out : [B, H, 512] float16/bfloat16/float32 (written).
    workspace : an :class:`MlaDecodeWorkspace` (checked against the geometry, else unused by
        the reference) or None.
    indices : int32 [B, K] or None.
    """
    b, h = check_decode_args(
        q,
        packed,
        block_table,
        seq_lens,
        block_pool_map,
        pool_latent,
        pool_scale,
        pool_rope,
        layout,
        out,
        workspace,
        indices,
        softmax_scale,
    )
    q_rot = hadamard(q[..., :LATENT_DIM].to(torch.float64))
    q_rope = q[..., LATENT_DIM:].to(torch.float64)
    for r in range(b):
        length = int(seq_lens[r])
        logical = torch.arange(length, device=q.device)
        if indices is not None:
            sel = indices[r].to(torch.long)
            logical = sel[sel >= 0]
        if logical.numel() == 0:
            out[r] = 0
            continue
        phys = block_table[r, logical // GROUP].to(torch.long) * GROUP + logical % GROUP
        lat, rope = read_tokens(
            packed, block_pool_map, pool_latent, pool_scale, pool_rope, phys, layout
        )
        lat, rope = lat.to(torch.float64), rope.to(torch.float64)
        s = (q_rot[r] @ lat.T + q_rope[r] @ rope.T) * softmax_scale
        pr = torch.softmax(s, dim=-1)
        out[r] = hadamard(pr @ lat).to(out.dtype)
