"""The key of one compiled specialization, built from a kvarn-formats layout (no DSL import:
the AOT loader uses it on machines without the compiler)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import kvarn_formats as kf

_TORCH_NAMES = {
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "torch.float32": "float32",
    "torch.float8_e4m3fn": "float8_e4m3fn",
}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (strings pass through)."""
    text = str(dtype)
    return _TORCH_NAMES.get(text, text)


@dataclass(frozen=True)
class KernelSpec:
    """Everything one compiled specialization is fixed to (record geometry, query rows per KV
    head, dtypes). Batch, context length, head counts and cache sizes are runtime values."""

    k_bits: int
    v_bits: int
    group: int
    head_dim: int
    gqa: int
    query_len: int
    q_dtype: str
    pool_dtype: str
    out_dtype: str
    record_bytes: int
    k_codes: int
    k_col_scale: int
    k_zero_point: int
    k_row_scale: int
    v_codes: int
    v_col_scale: int
    v_row_scale: int
    v_zero_point: int

    @property
    def rows(self) -> int:
        """Query rows per KV head, ``T * GQA``."""
        return self.gqa * self.query_len

    @property
    def format_name(self) -> str:
        return f"kvarn_k{self.k_bits}v{self.v_bits}_g{self.group}"

    @property
    def name(self) -> str:
        """Unique, identifier-safe name; the exported FFI function is ``kvarn_decode_<name>``."""
        return (
            f"k{self.k_bits}v{self.v_bits}_g{self.group}_d{self.head_dim}_gqa{self.gqa}"
            f"_t{self.query_len}_q{self.q_dtype}_p{self.pool_dtype}_o{self.out_dtype}"
        )

    @property
    def function_name(self) -> str:
        return f"kvarn_decode_{self.name}"

    def to_json(self) -> dict:
        return asdict(self)


def make_spec(
    format_name: str, head_dim: int, gqa: int, query_len: int, q_dtype, pool_dtype, out_dtype=None
) -> KernelSpec:
    """The specialization serving ``format_name`` at ``head_dim`` for ``gqa`` query heads per
    KV head and ``query_len`` query tokens."""
    lay = kf.dense_layout(format_name, head_dim)
    fmt = kf.parse_format(format_name)
    assert isinstance(fmt, kf.DenseFormat)  # dense_layout refused anything else
    f = lay.field
    return KernelSpec(
        k_bits=fmt.k_bits,
        v_bits=fmt.v_bits,
        group=lay.block_size,
        head_dim=head_dim,
        gqa=gqa,
        query_len=query_len,
        q_dtype=dtype_name(q_dtype),
        pool_dtype=dtype_name(pool_dtype),
        out_dtype=dtype_name(out_dtype or q_dtype),
        record_bytes=lay.record_bytes,
        k_codes=f("k_codes").offset,
        k_col_scale=f("k_col_scale").offset,
        k_zero_point=f("k_zero_point").offset,
        k_row_scale=f("k_row_scale").offset,
        v_codes=f("v_codes").offset,
        v_col_scale=f("v_col_scale").offset,
        v_row_scale=f("v_row_scale").offset,
        v_zero_point=f("v_zero_point").offset,
    )


MIN_UNITS_PER_SPLIT = 2
"""A split gets at least this many work units when the context allows (as kvarn-ops)."""


def split_plan(length: int, group: int, num_splits: int) -> list[tuple[int, int]]:
    """Work units ``[u0, u1)`` of each live split of a request of ``length`` tokens: the host
    mirror of the device formula in kernel.py (units = full blocks + 1 for a partial tail;
    ``per = cdiv(n, min(S, cdiv(n, MIN_UNITS)))``; ``cdiv(n, per)`` live splits)."""
    n_full, tail = divmod(length, group)
    units = max(1, n_full + (1 if tail else 0))
    live = min(num_splits, -(-units // MIN_UNITS_PER_SPLIT))
    per = -(-units // live)
    live = -(-units // per)
    return [(s * per, min(units, (s + 1) * per)) for s in range(live)]
