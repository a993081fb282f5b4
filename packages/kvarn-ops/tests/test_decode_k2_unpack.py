"""The 2-bit K unpack of the MMA decode kernels (``decode_mma._k2_codes``, which all of them
use), on the CPU: the words each lane stages (``decode_mma._stage_words`` at ``KB = 2``), the
``prmt`` selector each lane uses and the PTX of ``decode_mma.k2_crumbs_asm`` executed by the
emulator of ``test_mla_wgmma_unpack`` on real records, against the reference's codes.

The Gluon kernel itself runs only on a GPU (``gpu/test_dense_parity.py``); this checks what a
new code width is most likely to get wrong: which word a lane copies, which bytes of it are
its tokens, and the fields' bit windows and factors. Exact: every code of every lane, chunk
and 64-token half must come out as ``c / F`` with ``F`` the kernel's factor of its row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvarn_formats as kf
from kvarn_ops import reference as ref
from kvarn_ops.kernels import decode_mma
from test_mla_wgmma_unpack import _f16x2, run_ptx

SEL0 = decode_mma.K2_SEL_BYTE0.value
SEL_BYTE = decode_mma.K2_SEL_BYTE.value
SEL_ODD = decode_mma.K2_SEL_ODD_LANE.value


def _words_and_codes(fmt: str, gen: torch.Generator):
    """Two real records of ``fmt`` at head_dim 128: the K code words as uint32 [N, R / 4]
    (the whole record, as the kernel indexes it), the reference's K codes [N, D, G], and the
    K field's offset in words."""
    lay = kf.dense_layout(fmt, 128)
    g = lay.block_size
    k = torch.randn(2, g, 128, generator=gen) * torch.rand(2, 1, 128, generator=gen) * 3
    k[1] += 4 * torch.randn(1, 128, generator=gen)  # channel offsets: zero points of both signs
    v = torch.randn(2, g, 128, generator=gen)
    rec = ref.encode_records(k, v, lay)
    codes = ref.record_fields(rec, lay)["k_codes"].numpy().astype(np.int64)
    assert len(np.unique(codes)) == 4  # every 2-bit value occurs
    words = rec.contiguous().view(torch.int32).numpy().view(np.uint32)
    return words, codes, lay.field("k_codes").offset // 4, g


def _staged_word(words, k_off, g, half, ln, r):
    """The word lane ``ln`` stages at row ``r`` (``8 chunk + i``) of a 64-token half, as
    ``decode_mma.k_word_offsets`` computes its address at ``KB = 2`` (its lane rule
    ``k_lane_shift`` called here)."""
    koff = ((ln & 3) * 32 + r) * (g * 2 // 32) + (ln >> decode_mma.k_lane_shift(2))
    return words[:, k_off + half * 4 + koff]


@pytest.mark.parametrize("fmt", ["kvarn_k2v2_g64", "kvarn_k2v4_g128"])
def test_k2_operand_is_every_code_exactly(fmt, gen):
    words, codes, k_off, g = _words_and_codes(fmt, gen)
    asm = decode_mma.k2_crumbs_asm()
    factors = [decode_mma._crumb_factor(f, False) for f in range(4)]
    assert sorted(factors) == [4.0, 16.0, 64.0, 256.0]
    seen = np.zeros(codes.shape, dtype=np.int64)
    for half in range(g // 64):
        for ln in range(32):
            c, w = ln & 3, ln >> 2
            for cq in range(4):
                for i in range(0, 8, 2):  # channel pairs (i, i + 1) of the lane's run
                    ch = 32 * c + 8 * cq + i
                    a = _staged_word(words, k_off, g, half, ln, 8 * cq + i)
                    b = _staged_word(words, k_off, g, half, ln, 8 * cq + i + 1)
                    for byte in range(2):
                        sel = np.full_like(a, SEL0 + (w & 1) * SEL_ODD + byte * SEL_BYTE)
                        outs = run_ptx(asm, [a, b, sel, sel], outputs=4)
                        for f, out in enumerate(outs):
                            tok = half * 64 + 8 * w + 4 * byte + f
                            for dc, val in enumerate(_f16x2(out)):  # channels ch, ch + 1
                                np.testing.assert_array_equal(
                                    val * factors[f], codes[:, ch + dc, tok]
                                )
                                seen[:, ch + dc, tok] += 1
    assert (seen == 1).all()  # every code of the record, once
