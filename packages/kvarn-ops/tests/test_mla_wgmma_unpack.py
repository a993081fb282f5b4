"""The ``wgmma`` MLA decode kernel's 4-, 5- and 2-bit unpacks, on the CPU: the PTX each code
pair runs (``mla_decode_wgmma.dq_asm``, ``dq5_asm``) executed by a small
emulator of its instructions on the code words of real records, against the reference's codes
and one rounding of ``cs code + zp``; and the tiles' token order.

The Gluon kernel itself runs only on an sm_90 GPU (``gpu/test_mla_parity.py``); this checks
the part most likely to be wrong in a new code width, the bit windows (which word, which
shift, which pairs straddle two words) and the fp16 arithmetic of the inline assembly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvarn_formats as kf
from kvarn_ops.kernels import mla_decode_wgmma as kw
from kvarn_ops.reference.mla import encode_mla_records, record_tensors

M32 = np.uint64(0xFFFFFFFF)


def _imm(tok: str) -> np.uint64:
    return np.uint64(int(tok, 0))


def _f16x2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two fp16 halves (low, high) of 32-bit registers, as float64."""
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _pack_f16x2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """fp16 round-to-nearest of both halves (exact float64 inputs), packed."""
    bl = lo.astype(np.float16).view(np.uint16).astype(np.uint64)
    bh = hi.astype(np.float16).view(np.uint16).astype(np.uint64)
    return bl | (bh << np.uint64(16))


def instructions(asm: str) -> list[tuple[str, list[str]]]:
    """The ``(opcode, operands)`` of an inline-assembly block, register declarations left out."""
    body = asm.strip().removeprefix("{").removesuffix("}")
    out = []
    for ins in (x.strip() for x in body.split(";")):
        if ins and not ins.startswith(".reg"):
            op, rest = ins.split(None, 1)
            out.append((op, [t.strip() for t in rest.split(",")]))
    return out


def run_ptx(asm: str, args: list[np.ndarray], outputs: int = 1):
    """Execute the inline-assembly block ``asm`` (``$0 .. $(outputs - 1)`` its outputs, the
    next ones its inputs as uint32 arrays) for the instructions the kernels use; anything else
    fails the test. Returns ``$0``, or the list of outputs when there are several."""
    regs: dict[str, np.ndarray] = {
        f"${k + outputs}": a.astype(np.uint64) for k, a in enumerate(args)
    }

    def val(tok: str) -> np.ndarray:
        return regs[tok] if tok in regs else np.full_like(args[0], _imm(tok), dtype=np.uint64)

    for op, ops in instructions(asm):
        d = ops[0]
        if op == "mov.b32":
            regs[d] = val(ops[1]) & M32
        elif op in ("shr.u32", "shr.b32"):  # logical shifts both
            regs[d] = val(ops[1]) >> _imm(ops[2])
        elif op == "shf.r.clamp.b32":
            sh = min(int(ops[3], 0), 32)
            wide = val(ops[1]) | (val(ops[2]) << np.uint64(32))
            regs[d] = (wide >> np.uint64(sh)) & M32
        elif op == "lop3.b32":
            a, b, c, lut = val(ops[1]), val(ops[2]), val(ops[3]), int(ops[4], 0)
            out = np.zeros_like(a)
            for bit in range(32):
                sel = (
                    (((a >> np.uint64(bit)) & np.uint64(1)) << np.uint64(2))
                    | (((b >> np.uint64(bit)) & np.uint64(1)) << np.uint64(1))
                    | ((c >> np.uint64(bit)) & np.uint64(1))
                )
                out |= ((np.uint64(lut) >> sel) & np.uint64(1)) << np.uint64(bit)
            regs[d] = out
        elif op == "prmt.b32":  # default mode: selector nibble k picks byte k of {b, a}
            wide = val(ops[1]) | (val(ops[2]) << np.uint64(32))
            sel = val(ops[3])
            out = np.zeros_like(wide)
            for k in range(4):
                byte = (sel >> np.uint64(4 * k)) & np.uint64(7)
                out |= ((wide >> (byte * np.uint64(8))) & np.uint64(0xFF)) << np.uint64(8 * k)
            regs[d] = out
        elif op == "sub.f16x2":
            (al, ah), (bl, bh) = (_f16x2(val(t)) for t in ops[1:3])
            regs[d] = _pack_f16x2(al - bl, ah - bh)
        elif op == "fma.rn.f16x2":
            (al, ah), (bl, bh), (cl, ch) = (_f16x2(val(t)) for t in ops[1:4])
            # fp16 products are exact in float64, and so are these sums (operands within
            # 2^-24 .. 2^16): one rounding, to fp16, as the instruction
            regs[d] = _pack_f16x2(al * bl + cl, ah * bh + ch)
        else:
            raise AssertionError(f"instruction the emulator does not know: {op} {ops}")
    return regs["$0"] if outputs == 1 else [regs[f"${k}"] for k in range(outputs)]


def _records(bits: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    layout = kf.mla_layout(f"kvarn_mla_k{bits}_g64")
    n = 3
    latent = torch.randn(n, 64, 512, generator=gen) * torch.rand(n, 1, 512, generator=gen) * 4
    latent[1] += 5 * torch.randn(1, 512, generator=gen)  # offsets: zero points of both signs
    rope = torch.randn(n, 64, 64, generator=gen).to(torch.bfloat16)
    return encode_mla_records(latent, rope, layout), layout


def _fields(bits: int, seed: int):
    """The code words [N, 512, 2 bits] of real ``bits``-bit records, their fp16 pairs (cs, cs)
    and (zp, zp) as uint32 [N, 512], and the tile ``fp16(cs code + zp)`` [N, 512, 64] of the
    reference's codes."""
    rec, layout = _records(bits, seed)
    f = record_tensors(rec, layout)
    codes = f["codes"].numpy().astype(np.int64)
    cs = f["col_scale"].numpy()
    zp = f["zero_point"].numpy()
    assert len(np.unique(codes)) == 1 << bits  # every code value occurs
    fl = layout.field("codes")
    words = rec[:, fl.offset : fl.end].contiguous().view(torch.int32).numpy()
    words = words.reshape(rec.shape[0], 512, 2 * bits).view(np.uint32)
    cs2 = np.uint32(cs.view(np.uint16)) * np.uint32(0x10001)
    zp2 = np.uint32(zp.view(np.uint16)) * np.uint32(0x10001)
    exact = cs.astype(np.float64)[..., None] * codes + zp.astype(np.float64)[..., None]
    return words, cs2, zp2, exact.astype(np.float16)


def test_pairs_cover_every_token_once():
    """The kernel's pairs (codes ``8 G + i`` and ``+ 4``, i < 4, of each half-row) name each of
    a half-row's 32 codes once, and every window lies in the half-row's five words."""
    seen = []
    for g in range(4):
        for i in range(4):
            c = 8 * g + i
            seen += [c, c + 4]
            assert kw.pair5_word(c) + kw.pair5_straddles(c) <= 4
            assert 5 * c + 25 <= 32 * (kw.pair5_word(c) + 1 + kw.pair5_straddles(c))
    assert sorted(seen) == list(range(32))
    assert sum(kw.pair5_straddles(8 * g + i) for g in range(4) for i in range(4)) == 12


@pytest.mark.parametrize("seed", [0, 1])
def test_dq5_asm_matches_reference_codes(seed):
    """Every code pair of every channel of real 5-bit records through the emulated PTX:
    ``fp16(cs code + zp)`` with one rounding, for the reference's codes of the tokens the
    pair names, with the record's own fp16 scales and zero points."""
    words, cs2, zp2, want = _fields(5, seed)
    got = np.full(want.shape, np.nan, np.float16)
    for h in range(2):
        for g in range(4):
            for i in range(4):
                c = 8 * g + i
                k = 5 * h + kw.pair5_word(c)
                lo = words[..., k]
                hi = words[..., k + 1] if kw.pair5_straddles(c) else lo
                out = run_ptx(kw.dq5_asm(c), [lo, hi, cs2, zp2])
                pair = out.astype(np.uint32).view(np.float16).reshape(*lo.shape, 2)
                got[..., 32 * h + c] = pair[..., 0]
                got[..., 32 * h + c + 4] = pair[..., 1]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", [0, 1])
def test_dq_asm_2bit_matches_reference_codes(seed):
    """The 2-bit pairs (codes ``i`` and ``i + 8`` of each word, 16 bits apart) of every
    channel of real records through the emulated PTX: ``fp16(cs code + zp)``, one rounding."""
    words, cs2, zp2, want = _fields(2, seed)
    got = np.full(want.shape, np.nan, np.float16)
    for j in range(4):
        for i in range(8):
            w = words[..., j]
            out = run_ptx(kw.dq_asm(2, i), [w, w, cs2, zp2])
            pair = out.astype(np.uint32).view(np.float16).reshape(*w.shape, 2)
            got[..., 16 * j + i] = pair[..., 0]
            got[..., 16 * j + i + 8] = pair[..., 1]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", [0, 1])
def test_dq_asm_4bit_matches_reference_codes(seed):
    """The 4-bit pairs (codes ``k`` and ``k + 4`` of each word, 16 bits apart) of every channel
    of real records through the emulated PTX: ``fp16(cs code + zp)``, one rounding."""
    words, cs2, zp2, want = _fields(4, seed)
    got = np.full(want.shape, np.nan, np.float16)
    for j in range(8):
        for k in range(4):
            w = words[..., j]
            out = run_ptx(kw.dq_asm(4, k), [w, w, cs2, zp2])
            pair = out.astype(np.uint32).view(np.float16).reshape(*w.shape, 2)
            got[..., 8 * j + k] = pair[..., 0]
            got[..., 8 * j + k + 4] = pair[..., 1]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("bits", "dims", "pair_axis", "token"),
    [
        # the unpacks' register tensors: dimension sizes after the channel axis, the axis of
        # each register's fp16 pair, and the token each index names (the comments in
        # _chunk_tile4 / 5 / 2)
        (4, (8, 2, 4), 1, lambda j, r, k: 8 * j + 4 * r + k),
        (5, (2, 4, 4, 2), 0, lambda r, i, g, h: 32 * h + 8 * g + 4 * r + i),
        (2, (2, 4, 2, 4), 0, lambda r, a, b, j: 16 * j + 8 * r + 4 * b + a),
    ],
)
def test_tile_token_order_is_the_unpacks(bits, dims, pair_axis, token):
    """The tile's token order (``tile_token``, which the kernels' RoPE rows, row scales and
    token masks follow) is the unpack's: its register tensor, labelled with the token of each
    index, permuted and flattened as the kernel does, gives ``tile_token`` at every position;
    it is a permutation of the block's 64 tokens that keeps each fp16 pair (the tokens 16 or
    20 bits apart in the record) side by side."""
    perm = {4: kw.TILE_PERM4, 5: kw.TILE_PERM5, 2: kw.TILE_PERM2}[bits].value
    labels = np.zeros((1, *dims), dtype=np.int64)
    for idx in np.ndindex(*dims):
        labels[(0, *idx)] = token(*idx)
    order = np.transpose(labels, perm).reshape(64)
    want = [kw.tile_token(q, bits) for q in range(64)]
    assert order.tolist() == want
    assert sorted(want) == list(range(64))
    assert want != list(range(64))
    # each register's two codes (index 0 and 1 of the pair axis) at positions 2 m, 2 m + 1
    for idx in np.ndindex(*dims):
        if idx[pair_axis] == 0:
            hi = list(idx)
            hi[pair_axis] = 1
            q = want.index(token(*idx))
            assert q % 2 == 0 and want[q + 1] == token(*hi)


def test_emulator_runs_the_kernels_asm_only():
    """The pairs the kernel unpacks use every instruction the emulator knows and no other: all
    of each width's code paths (window by move, shift or funnel shift) ran above."""
    pairs5 = [8 * g + i for g in range(4) for i in range(4)]
    ops5 = {op for c in pairs5 for op, _ in instructions(kw.dq5_asm(c))}
    assert ops5 == {"mov.b32", "shr.u32", "shf.r.clamp.b32", "lop3.b32", "fma.rn.f16x2"}
    ops2 = {op for i in range(8) for op, _ in instructions(kw.dq_asm(2, i))}
    assert ops2 == {"mov.b32", "shr.u32", "lop3.b32", "sub.f16x2", "fma.rn.f16x2"}
    ops4 = {op for k in range(4) for op, _ in instructions(kw.dq_asm(4, k))}
    assert ops4 == {"mov.b32", "shr.u32", "lop3.b32", "sub.f16x2", "fma.rn.f16x2"}
