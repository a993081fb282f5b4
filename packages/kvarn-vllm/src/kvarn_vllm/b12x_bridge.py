"""Optional bridge to b12x's sparse-MLA decode (SM120/SM121 GPUs only).

b12x (``pip install 'kvarn-vllm[b12x]'``, exactly ``b12x==1.5.1``) has an SM120/121 decode over
top-k-selected MLA tokens whose cache record is the 656-byte fp8 record that kvarn stages
(``kvarn_formats.STAGED_MLA_FP8``; b12x calls it the GLM_NSA recipe: 512 e4m3 latent bytes,
four fp32 scales per 128 dims with value = fp8 * scale, 64 bf16 RoPE values at byte 528). The
bridge gathers the selected tokens of each request from the KVarN MLA cache (packed tiles plus
exact pool) into such records with kvarn_ops' ``mla_stage_fp8`` and runs b12x's decode on them:

    decoder = B12xSparseMlaDecoder(num_heads=16, max_batch=8, topk=2048,
                                   softmax_scale=576 ** -0.5, device="cuda")
    decoder(q, cache, slots, out)   # q [B, H, 576] model frame, slots int64 [B, K] physical

b12x is imported when a bridge function needs it, never when kvarn_vllm is imported, and
everything it needs is checked first: :func:`load_b12x` raises :class:`B12xUnavailable`, naming
what is missing (b12x not installed, another version, a function or parameter we call, a GPU
that is not SM120/121). Importing this module imports neither torch nor b12x.

Frames: staged records keep the latent in the rotated frame (``latent @ H_512``), so the bridge
rotates the absorbed query latent by ``H_512`` and b12x's output back (``H`` is symmetric and
its own inverse); RoPE parts are not rotated.

b12x's own vLLM plugins (``b12x_fp6``, ``b12x_loader``) load in every vLLM process unless
``VLLM_PLUGINS`` filters them; :func:`vllm_plugin_leaks` says which ones would load.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "B12X_VERSION",
    "REQUIRED_API",
    "SUPPORTED_CAPABILITIES",
    "B12xSparseMlaDecoder",
    "B12xUnavailable",
    "MlaCache",
    "StagedDecode",
    "api_problems",
    "caps_kwargs",
    "check_capability",
    "finish_decode",
    "load_b12x",
    "stage_decode",
    "staging_rows",
    "vllm_plugin_leaks",
]

B12X_VERSION = "1.5.1"
"""The only b12x release the bridge was written against (b12x pins nvidia-cutlass-dsl exactly
and changes its API between releases)."""
SUPPORTED_CAPABILITIES = ((12, 0), (12, 1))
"""CUDA compute capabilities b12x builds for (SM120, SM121); it fails at ptxas on SM90."""
INSTALL_HINT = f"pip install 'kvarn-vllm[b12x]' (b12x=={B12X_VERSION})"
SPARSE_MLA_MODULE = "b12x.attention.sparse_mla"

LATENT_DIM = 512
ROPE_DIM = 64
STAGED_BYTES = 656
PAGE_SIZE = 64
"""Rows per page of the staging buffer (b12x's sparse-MLA page size; a contiguous cache is
addressed by flat row, ``page * 64 + row``)."""
ARBITRARY_FP32_SCALES = 1
"""b12x's ``ScaleFormat.ARBITRARY_FP32``: inline fp32 scales, value = fp8 * scale."""

REQUIRED_API: dict[str, tuple[str, ...]] = {
    "Caps": (
        "device",
        "num_q_heads",
        "max_q_rows",
        "max_width",
        "softmax_scale",
        "dtype",
        "kv_dtype",
        "head_dim",
        "v_head_dim",
        "model_type",
        "scale_format",
        "cache_record_bytes",
        "mode",
        "max_batch",
        "max_page_table_width",
        "page_size",
    ),
    "plan": ("caps",),
    "bind": (
        "plan",
        "scratch",
        "q",
        "kv_cache",
        "selected_indices",
        "cache_lengths",
        "selected_lengths",
    ),
    "run": ("binding",),
    "is_supported": ("device",),
}
"""Every callable of ``b12x.attention.sparse_mla`` the bridge calls, with the parameters it
passes (by name). ``ModelType.GLM_NSA`` is checked as well."""

_VLLM_PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins")


class B12xUnavailable(RuntimeError):
    """b12x cannot be used here; the message names what is missing and the fix."""


# ---------------------------------------------------------------------------------------------
# checks


def _version_problem() -> str | None:
    try:
        installed = metadata.version("b12x")
    except metadata.PackageNotFoundError:
        return f"b12x is not installed: {INSTALL_HINT}"
    if installed != B12X_VERSION:
        return (
            f"b12x {installed} is installed, the bridge needs exactly b12x=={B12X_VERSION}: "
            f"{INSTALL_HINT}"
        )
    return None


def api_problems(module: Any) -> list[str]:
    """What ``module`` (``b12x.attention.sparse_mla``) lacks of :data:`REQUIRED_API`, as
    ``"name"`` (missing callable) or ``"name(param)"`` (missing parameter) strings."""
    problems = []
    for name, params in REQUIRED_API.items():
        obj = getattr(module, name, None)
        if obj is None or not callable(obj):
            problems.append(name)
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            problems.append(f"{name}(<no signature>)")
            continue
        has_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        problems += [f"{name}({p})" for p in params if p not in sig.parameters and not has_kwargs]
    if getattr(getattr(module, "ModelType", None), "GLM_NSA", None) is None:
        problems.append("ModelType.GLM_NSA")
    return problems


def check_capability(device: Any = None, capability: tuple[int, int] | None = None) -> None:
    """Raise :class:`B12xUnavailable` unless the GPU is SM120/SM121.

    Parameters
    ----------
    device : the CUDA device to ask (default: the current one).
    capability : (major, minor) to check instead of asking torch (tests, offline planning).
    """
    if capability is None:
        import torch

        if not torch.cuda.is_available():
            raise B12xUnavailable("no CUDA device: b12x needs an SM120/121 GPU")
        major, minor = torch.cuda.get_device_capability(device)
    else:
        major, minor = capability
    if (major, minor) not in SUPPORTED_CAPABILITIES:
        raise B12xUnavailable(
            f"sm_{major}{minor}: b12x needs SM120/121 (compute capability 12.0 or 12.1)"
        )


def load_b12x(
    *, device: Any = None, capability: tuple[int, int] | None = None, check_device: bool = True
) -> Any:
    """Check b12x and return its ``b12x.attention.sparse_mla`` module.

    Checks, in order: b12x installed and exactly :data:`B12X_VERSION`; the module imports;
    it has every name and parameter of :data:`REQUIRED_API`; then, when ``check_device``, the
    GPU (:func:`check_capability`) and b12x's own ``is_supported`` for it (skipped when
    ``capability`` is given, as no real device is asked then).

    Raises
    ------
    B12xUnavailable
        naming what is missing.
    """
    problem = _version_problem()
    if problem is not None:
        raise B12xUnavailable(problem)
    try:
        module = importlib.import_module(SPARSE_MLA_MODULE)
        getattr(module, "plan", None)  # b12x loads an op's API lazily: this imports it
    except Exception as exc:  # noqa: BLE001 - any import failure means "unusable"
        raise B12xUnavailable(
            f"b12x {B12X_VERSION} is installed but {SPARSE_MLA_MODULE} cannot be imported "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    missing = api_problems(module)
    if missing:
        raise B12xUnavailable(
            f"b12x {B12X_VERSION}: {SPARSE_MLA_MODULE} lacks what the bridge calls: "
            + ", ".join(missing)
        )
    if check_device:
        check_capability(device, capability)
        if capability is None and not module.is_supported(device):
            raise B12xUnavailable(
                f"{SPARSE_MLA_MODULE}.is_supported() is False on this SM120/121 device "
                "(b12x also needs nvidia-cutlass-dsl and triton)"
            )
    return module


def vllm_plugin_leaks(environ: Mapping[str, str] | None = None) -> list[str]:
    """Names of b12x's vLLM plugins that vLLM would load under ``environ`` (default: this
    process's environment): all of them when ``VLLM_PLUGINS`` is unset, else those it lists
    (vLLM's rule: a comma-separated list of entry-point names)."""
    env = os.environ if environ is None else environ
    allowed = env["VLLM_PLUGINS"].split(",") if "VLLM_PLUGINS" in env else None
    names = set()
    for group in _VLLM_PLUGIN_GROUPS:
        for ep in metadata.entry_points(group=group):
            if ep.value.split(":")[0].split(".")[0] == "b12x":
                names.add(ep.name)
    return sorted(n for n in names if allowed is None or n in allowed)


# ---------------------------------------------------------------------------------------------
# staging


@dataclass(frozen=True)
class MlaCache:
    """One MLA layer's KVarN cache (docs/contracts.md, "kvarn-ops: the MLA cache").

    packed uint8 [num_blocks, R]; block_pool_map int32 [num_blocks]; pool_latent [P, 64, 512]
    bf16/fp8; pool_scale float32 [P, 64] or None; pool_rope bf16 [P, 64, 64]; layout from
    ``kvarn_formats.mla_layout``.
    """

    packed: torch.Tensor
    block_pool_map: torch.Tensor
    pool_latent: torch.Tensor
    pool_scale: torch.Tensor | None
    pool_rope: torch.Tensor
    layout: Any


@dataclass(frozen=True)
class StagedDecode:
    """The tensors b12x's sparse-MLA decode reads (all contiguous, on the cache's device).

    q bf16 [B, H, 576]: latent part rotated by ``H_512``, RoPE part as given.
    kv_cache uint8 [pages, 64, 656]: staged records; request b's j-th selected token is row
    ``b * width + j``. selected_indices int32 [B, width]: those rows, valid ones first, -1
    after. selected_lengths int32 [B]: valid entries per request.
    """

    q: torch.Tensor
    kv_cache: torch.Tensor
    selected_indices: torch.Tensor
    selected_lengths: torch.Tensor


def _default_stage_op(device: torch.device) -> Callable[..., None]:
    """kvarn_ops' ``mla_stage_fp8``: the Triton kernel on CUDA, the torch reference elsewhere
    (same signature, byte-exact equal)."""
    if device.type == "cuda":
        from kvarn_ops.kernels.mla_gather import mla_stage_fp8
    else:
        from kvarn_ops.reference.mla import mla_stage_fp8
    return mla_stage_fp8


@functools.lru_cache(maxsize=8)
def _hadamard_512(device: str) -> torch.Tensor:
    import torch

    from kvarn_ops.reference import hadamard_matrix

    return hadamard_matrix(LATENT_DIM, torch.float32, device)


def staging_rows(max_batch: int, width: int) -> int:
    """Rows of the staging buffer for ``max_batch`` requests of ``width`` selected tokens,
    rounded up to whole pages of :data:`PAGE_SIZE`."""
    for name, value in (("max_batch", max_batch), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
    return -(-max_batch * width // PAGE_SIZE) * PAGE_SIZE


def stage_decode(
    q: torch.Tensor,
    cache: MlaCache,
    slots: torch.Tensor,
    *,
    width: int,
    records: torch.Tensor,
    q_out: torch.Tensor | None = None,
    stage_op: Callable[..., None] | None = None,
) -> StagedDecode:
    """Stage the selected tokens of each request and the rotated query for b12x.

    Parameters
    ----------
    q : [B, H, 576] float (model frame: absorbed query latent, then RoPE part).
    slots : int64 [B, K] physical slots (``block * 64 + offset``, e.g. from
        ``mla_remap_indices``), -1 = not selected; K <= width.
    width : b12x's planned top-k width (its GLM_NSA route needs exactly this width).
    records : uint8 [N, 656] or [N // 64, 64, 656], contiguous, N >= B * width (see
        :func:`staging_rows`); rows of unselected entries keep what they held (never read).
    q_out : bf16 [>= B, H, 576] contiguous buffer for the rotated query (allocated if None).
    stage_op : ``mla_stage_fp8`` to use (default: kernel on CUDA, reference elsewhere).

    Runs on the device without a host sync; the selection is compacted (valid entries first)
    so that ``selected_lengths`` alone bounds what b12x reads.
    """
    import torch

    if q.dim() != 3 or q.shape[2] != LATENT_DIM + ROPE_DIM:
        raise ValueError(f"q: expected [B, H, {LATENT_DIM + ROPE_DIM}], got {tuple(q.shape)}")
    b, h, d = q.shape
    if slots.dtype != torch.int64 or slots.dim() != 2 or slots.shape[0] != b:
        raise ValueError(f"slots: expected int64 [{b}, K], got {slots.dtype} {tuple(slots.shape)}")
    k = slots.shape[1]
    if k > width:
        raise ValueError(f"slots: {k} columns, more than the planned width {width}")
    if (
        records.dtype != torch.uint8
        or not records.is_contiguous()
        or records.shape[-1] != STAGED_BYTES
        or records.numel() % (PAGE_SIZE * STAGED_BYTES)
    ):
        raise ValueError(
            "records: must be contiguous uint8 [N, 656] or [N // 64, 64, 656] with N a "
            f"multiple of 64, got {records.dtype} {tuple(records.shape)}"
        )
    flat_records = records.view(-1, STAGED_BYTES)
    if flat_records.shape[0] < b * width:
        raise ValueError(f"records: {flat_records.shape[0]} rows, need {b * width}")
    dev = slots.device
    # every argument is checked before anything is written
    if q_out is None:
        q_out = torch.empty(b, h, d, dtype=torch.bfloat16, device=dev)
    if (
        q_out.dtype != torch.bfloat16
        or not q_out.is_contiguous()
        or q_out.dim() != 3
        or q_out.shape[0] < b
        or q_out.shape[1:] != q.shape[1:]
    ):
        raise ValueError(
            f"q_out: must be contiguous bfloat16 [>= {b}, {h}, {d}] (q's heads and width), got "
            f"{q_out.dtype} {tuple(q_out.shape)}"
        )

    valid = slots >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    compact = torch.full((b, width), -1, dtype=torch.int64, device=dev)
    compact[:, :k] = slots.gather(1, order)
    op = stage_op if stage_op is not None else _default_stage_op(dev)
    op(
        cache.packed,
        cache.block_pool_map,
        cache.pool_latent,
        cache.pool_scale,
        cache.pool_rope,
        compact.reshape(-1),
        cache.layout,
        flat_records[: b * width],
    )
    rows = torch.arange(b * width, dtype=torch.int32, device=dev).view(b, width)
    selected = torch.where(compact >= 0, rows, torch.full_like(rows, -1))
    lengths = valid.sum(dim=1, dtype=torch.int32)

    qb = q_out[:b]
    qb[..., :LATENT_DIM] = q[..., :LATENT_DIM].float() @ _hadamard_512(str(dev))
    qb[..., LATENT_DIM:] = q[..., LATENT_DIM:]
    return StagedDecode(
        q=qb,
        kv_cache=flat_records.view(-1, PAGE_SIZE, STAGED_BYTES),
        selected_indices=selected,
        selected_lengths=lengths,
    )


def finish_decode(result: torch.Tensor, selected_lengths: torch.Tensor, out: torch.Tensor) -> None:
    """Write b12x's output ``result`` [B, H, 512] (rotated frame) into ``out`` [B, H, 512]
    (model frame, any float dtype); a request with an empty selection gets zeros (the
    ``kvarn_ops`` ``mla_decode`` rule)."""
    import torch

    if result.dim() != 3 or result.shape[2] != LATENT_DIM:
        raise ValueError(f"result: expected [B, H, {LATENT_DIM}], got {tuple(result.shape)}")
    if out.shape != result.shape:
        raise ValueError(
            f"out: expected {tuple(result.shape)} (result's shape), got {tuple(out.shape)}"
        )
    if selected_lengths.shape != (result.shape[0],):
        raise ValueError(
            f"selected_lengths: expected [{result.shape[0]}], got {tuple(selected_lengths.shape)}"
        )
    model = result.float() @ _hadamard_512(str(result.device))
    empty = (selected_lengths == 0).view(-1, 1, 1)
    out.copy_(torch.where(empty, torch.zeros_like(model), model))


# ---------------------------------------------------------------------------------------------
# decode


def caps_kwargs(
    *, num_heads: int, max_batch: int, topk: int, softmax_scale: float, device: Any
) -> dict[str, Any]:
    """Keyword arguments of b12x's ``sparse_mla.Caps`` for decode over staged 656-byte
    records: one bf16 query row per request, GLM_NSA recipe (model type 1, inline fp32 scales),
    uint8 cache of 64-row pages. ``model_type`` is b12x's ``ModelType.GLM_NSA`` (1)."""
    import torch

    return {
        "device": device,
        "num_q_heads": num_heads,
        "max_q_rows": max_batch,
        "max_batch": max_batch,
        "max_width": topk,
        "softmax_scale": softmax_scale,
        "dtype": torch.bfloat16,
        "kv_dtype": torch.uint8,
        "head_dim": LATENT_DIM + ROPE_DIM,
        "v_head_dim": LATENT_DIM,
        "model_type": 1,
        "scale_format": ARBITRARY_FP32_SCALES,
        "cache_record_bytes": STAGED_BYTES,
        "mode": "decode",
        "max_page_table_width": staging_rows(max_batch, topk) // PAGE_SIZE,
        "page_size": PAGE_SIZE,
    }


class B12xSparseMlaDecoder:
    """Sparse-MLA decode of a KVarN MLA cache through b12x (SM120/121).

    Construction checks b12x and the GPU (:func:`load_b12x`), declares b12x's plan and
    allocates the staging buffer, the rotated-query buffer and b12x's scratch. ``plan`` is
    b12x's declarative plan: prepare it in a ``b12x.PreparationSession`` before serving (b12x
    otherwise compiles it on first use, with a warning; never inside a CUDA graph capture).
    """

    def __init__(
        self,
        *,
        num_heads: int,
        max_batch: int,
        topk: int,
        softmax_scale: float,
        device: Any = "cuda",
        capability: tuple[int, int] | None = None,
    ) -> None:
        import torch

        self.device = torch.device(device)
        self._b12x = load_b12x(device=self.device, capability=capability)
        kw = caps_kwargs(
            num_heads=num_heads,
            max_batch=max_batch,
            topk=topk,
            softmax_scale=softmax_scale,
            device=self.device,
        )
        kw["model_type"] = self._b12x.ModelType.GLM_NSA
        self.caps = self._b12x.Caps(**kw)
        self.plan = self._b12x.plan(self.caps)
        self.topk = topk
        self.max_batch = max_batch
        rows = staging_rows(max_batch, topk)
        self.records = torch.zeros(
            rows // PAGE_SIZE, PAGE_SIZE, STAGED_BYTES, dtype=torch.uint8, device=self.device
        )
        self.q_buf = torch.empty(
            max_batch, num_heads, LATENT_DIM + ROPE_DIM, dtype=torch.bfloat16, device=self.device
        )
        self.scratch = [
            torch.empty(s.shape, dtype=s.dtype, device=self.device)
            for s in self.plan.scratch_specs()
        ]

    def __call__(
        self,
        q: torch.Tensor,
        cache: MlaCache,
        slots: torch.Tensor,
        out: torch.Tensor,
        *,
        stage_op: Callable[..., None] | None = None,
    ) -> None:
        """``out[b] = softmax(scale * q[b] . k[t]) @ latent[t]`` over request b's selected
        tokens; q [B, H, 576] and out [B, H, 512] model frame, slots int64 [B, K] physical
        (-1 ignored, K <= topk), B <= max_batch."""
        if q.shape[0] > self.max_batch:
            raise ValueError(f"q: {q.shape[0]} requests, planned for {self.max_batch}")
        staged = stage_decode(
            q,
            cache,
            slots,
            width=self.topk,
            records=self.records,
            q_out=self.q_buf,
            stage_op=stage_op,
        )
        binding = self._b12x.bind(
            self.plan,
            scratch=self.scratch[0] if len(self.scratch) == 1 else self.scratch,
            q=staged.q,
            kv_cache=staged.kv_cache,
            selected_indices=staged.selected_indices,
            cache_lengths=staged.selected_lengths,
            selected_lengths=staged.selected_lengths,
        )
        result = self._b12x.run(binding)
        if isinstance(result, tuple):
            result = result[0]
        finish_decode(result, staged.selected_lengths, out)
