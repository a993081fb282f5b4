"""The accuracy harness: perplexity, attention-output error and greedy agreement of KV-cache
variants against the exact cache, on one model and one text.

Statistics: NLL differences are paired per chunk of G predicted tokens (the chunk of the
predicting position); with ``S_c`` the summed per-token difference of chunk c, N tokens and
n chunks, ``dNLL = sum(S_c) / N`` and ``SE = sqrt(n * var(S_c)) / N``. The PPL increase is
``exp(dNLL) - 1`` with standard error ``exp(dNLL) * SE``. A difference under two standard
errors is reported as not significant.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module, resources
from pathlib import Path

import torch

from kvarn_ops.evaluation import attention as att
from kvarn_ops.evaluation.variants import CacheVariant, make_variant

__all__ = [
    "Harness",
    "code_text_set",
    "default_token_ids",
    "pool_exact",
    "pool_texts",
    "pydoc_text_set",
    "paired_stats",
]


def default_token_ids() -> tuple[list[int], str]:
    """The shipped text: 2048 SmolLM2 token ids of CPython's LICENSE.txt; ``(ids, source)``."""
    data = json.loads(
        resources.files("kvarn_ops.evaluation").joinpath("data/license_2048.json").read_text()
    )
    return data["ids"], data["source"]


def _text_set(name: str) -> tuple[list[list[int]], str]:
    data = json.loads(resources.files("kvarn_ops.evaluation").joinpath(f"data/{name}").read_text())
    return data["texts"], data["source"]


def pydoc_text_set() -> tuple[list[list[int]], str]:
    """Six more texts for decisions between quantizers (one 2048-token text gives standard
    errors of 0.5-1.5 points at k4v2; six independent ones about 0.2): 2048 SmolLM2 token ids
    each from Python's library reference topics, shipped; ``(texts, source)``."""
    return _text_set("pydoc_6x2048.json")


def code_text_set() -> tuple[list[list[int]], str]:
    """Six texts of source code, a distribution unlike the prose of the other two sets: 2048
    SmolLM2 token ids from each of six CPython 3.11.7 standard-library modules (tokens
    1024-3071 of each file), shipped; ``(texts, source)``."""
    return _text_set("code_6x2048.json")


def pool_exact(exact: Sequence[dict]) -> dict:
    """The exact-cache summaries of several texts (:meth:`Harness.exact_summary`) as one:
    chunks pooled, NLL the mean over all predicted tokens."""
    if not exact:
        raise ValueError("exact: at least one text")
    n = sum(e["tokens"] for e in exact)
    nll = sum(e["nll"] * e["tokens"] for e in exact) / n
    return {
        "name": "exact",
        "nll": nll,
        "ppl": math.exp(nll),
        "chunk_nll_sums": [c for e in exact for c in e["chunk_nll_sums"]],
        "tokens": n,
        "texts": len(exact),
    }


def pool_texts(exact: Sequence[dict], variants: Sequence[dict]) -> dict:
    """One result row for runs of one variant on several texts: ``exact`` and ``variants``
    are the per-text exact summaries (:meth:`Harness.exact_summary`) and variant rows
    (:meth:`Harness.run_variant`), in the same text order. Chunks are pooled (the paired
    standard error is that of all of them), the NLL and the accumulated attention error are
    means over tokens and texts, details measured on the first text only are kept, and
    ``per_text`` holds each text's ``vs_exact``."""
    if len(exact) != len(variants) or not exact:
        raise ValueError(f"exact, variants: one run per text, got {len(exact)} and {len(variants)}")
    names = {v["name"] for v in variants}
    if len(names) != 1:
        raise ValueError(f"variants: runs of one variant expected, got {sorted(names)}")
    ex = pool_exact(exact)
    n = ex["tokens"]
    chunks = [c for v in variants for c in v["chunk_nll_sums"]]
    if len(chunks) != len(ex["chunk_nll_sums"]):
        raise ValueError("variants: chunk counts differ from the exact runs'")
    nll = sum(v["nll"] * e["tokens"] for v, e in zip(variants, exact, strict=True)) / n
    layers = [v["attn_error_accumulated"] for v in variants]
    row = dict(variants[0])
    row.update(
        nll=nll,
        ppl=math.exp(nll),
        chunk_nll_sums=chunks,
        vs_exact=paired_stats(chunks, ex["chunk_nll_sums"], n),
        attn_error_accumulated=[sum(col) / len(col) for col in zip(*layers, strict=True)],
        per_text=[v["vs_exact"] for v in variants],
        seconds=sum(v["seconds"] for v in variants),
    )
    return row


def paired_stats(chunk_a: list[float], chunk_b: list[float], n_tokens: int) -> dict:
    """PPL change of a over b from per-chunk NLL sums (same chunks, same tokens)."""
    s = torch.tensor(chunk_a, dtype=torch.float64) - torch.tensor(chunk_b, dtype=torch.float64)
    n = s.numel()
    d = float(s.sum()) / n_tokens
    se = math.sqrt(n * float(s.var(unbiased=True))) / n_tokens if n > 1 else float("nan")
    ratio = math.exp(d)
    return {
        "dnll": d,
        "dnll_se": se,
        "ppl_increase": ratio - 1.0,
        "ppl_increase_se": ratio * se,
        "significant": abs(d) > 2 * se,
    }


@dataclass
class _Run:
    nll: torch.Tensor  # [N] per predicted token
    attn_out: dict | None


class Harness:
    """Runs variants on one model and one token sequence.

    Parameters
    ----------
    model_dir : directory loadable by ``AutoModelForCausalLM.from_pretrained``.
    ids : token ids (the context; PPL over ``len(ids) - 1`` predictions).
    group : tile size G (chunks of the statistics).
    gen_prompt, gen_tokens : greedy generation from the first ``gen_prompt`` ids for
        ``gen_tokens`` tokens (0 to skip).
    static_queries : the static attention error uses the last this many query positions.
    threads : torch threads.
    """

    def __init__(
        self,
        model_dir: str | Path,
        ids: Sequence[int],
        *,
        group: int = 64,
        gen_prompt: int = 1024,
        gen_tokens: int = 256,
        static_queries: int = 512,
        threads: int = 1,
    ) -> None:
        transformers = import_module("transformers")

        torch.set_num_threads(threads)
        self.ids = torch.tensor([list(ids)], dtype=torch.long)
        self.group = group
        self.gen_prompt = min(gen_prompt, len(ids))
        self.gen_tokens = gen_tokens
        self.static_queries = static_queries
        name = att.register()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation=name
        ).eval()
        cfg = self.model.config
        vocab = getattr(cfg, "vocab_size", None)
        if int(self.ids.min()) < 0 or (vocab is not None and int(self.ids.max()) >= vocab):
            raise ValueError(
                f"ids: token ids must be in [0, {vocab}) for this model, found "
                f"{int(self.ids.min())}..{int(self.ids.max())}"
            )
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self._exact: _Run | None = None
        self._exact_gen: list[int] | None = None
        self._recorded: dict | None = None

    # -- passes -------------------------------------------------------------------------------
    @torch.no_grad()
    def _forward_nll(self, state: att.EvalState) -> torch.Tensor:
        att.use_state(state)
        try:
            logits = self.model(input_ids=self.ids, use_cache=False).logits[0, :-1].float()
        finally:
            att.use_state(None)
        tgt = self.ids[0, 1:]
        lse = torch.logsumexp(logits, dim=-1)
        return (lse - logits.gather(1, tgt[:, None])[:, 0]).double()

    def _chunks(self, nll: torch.Tensor) -> list[float]:
        g = self.group
        return [float(nll[i : i + g].sum()) for i in range(0, nll.numel(), g)]

    def exact(self) -> _Run:
        """The exact-cache pass (recorded once: per-layer q/k/v/outputs)."""
        if self._exact is None:
            st = att.EvalState(variant=None, record=True)
            nll = self._forward_nll(st)
            self._recorded = st.recorded
            outs = {layer: rec[3] for layer, rec in st.recorded.items()}
            self._exact = _Run(nll, outs)
        return self._exact

    @torch.no_grad()
    def greedy(self, variant: CacheVariant | None) -> list[int]:
        """Greedy tokens after the prompt, through a cache evolving as in serving."""
        from transformers import DynamicCache

        st = att.EvalState(variant=variant)
        att.use_state(st)
        try:
            cache = DynamicCache()
            out = self.model(
                input_ids=self.ids[:, : self.gen_prompt], past_key_values=cache, use_cache=True
            )
            toks = []
            nxt = out.logits[0, -1].argmax()
            for _ in range(self.gen_tokens):
                toks.append(int(nxt))
                out = self.model(input_ids=nxt.view(1, 1), past_key_values=cache, use_cache=True)
                nxt = out.logits[0, -1].argmax()
        finally:
            att.use_state(None)
        return toks

    @torch.no_grad()
    def static_error(self, variant: CacheVariant) -> dict:
        """Per layer, relative attention-output error with exact history K/V quantized (K
        only, V only, both) against exact attention, on the last ``static_queries`` queries."""
        self.exact()
        res: dict[str, list[float]] = {"k": [], "v": [], "kv": []}
        assert self._recorded is not None
        for layer in range(self.num_layers):
            q, k, v, _, scaling = self._recorded[layer]
            length = k.shape[1]
            t0 = max(length - self.static_queries, 0)
            qs = q[:, t0:]
            if variant.per_token:
                kq, vq = variant.roundtrip(k.float(), v.float())
            else:
                n = (length - 1) // variant.group
                st = att.EvalState(variant=variant)
                kq, vq = st.dequantized(layer, k, v, n)
            ref = att.mixed_attention(qs, k, v, k[:, :0], v[:, :0], t0, variant, scaling)
            for part, (kk, vv) in {
                "k": (kq, v[:, : kq.shape[1]]),
                "v": (k[:, : vq.shape[1]], vq),
                "kv": (kq, vq),
            }.items():
                o = att.mixed_attention(qs, k, v, kk, vv, t0, variant, scaling)
                res[part].append(float((o - ref).norm() / ref.norm()))
        return res

    def run_variant(
        self,
        variant: CacheVariant,
        *,
        generation: bool = True,
        static: bool = True,
        accumulated_split: bool = False,
    ) -> dict:
        """Every measurement of one variant against the exact cache."""
        ex = self.exact()
        t0 = time.time()
        st = att.EvalState(variant=variant, reference_out=ex.attn_out)
        nll = self._forward_nll(st)
        n = nll.numel()
        out = {
            "name": variant.name,
            "method": variant.method,
            "format": variant.fmt,
            "sink": variant.sink,
            "bits_per_element": variant.bits_per_element(self.head_dim),
            "nll": float(nll.mean()),
            "ppl": math.exp(float(nll.mean())),
            "chunk_nll_sums": self._chunks(nll),
            "vs_exact": paired_stats(self._chunks(nll), self._chunks(ex.nll), n),
            "attn_error_accumulated": [
                math.sqrt(st.err2[i] / st.ref2[i]) for i in range(self.num_layers)
            ],
        }
        if accumulated_split and not variant.exact:
            for part in ("k", "v"):
                pv = make_variant(variant.method, variant.fmt, variant.sink, parts=part)
                sp = att.EvalState(variant=pv, reference_out=ex.attn_out)
                pn = self._forward_nll(sp)
                out[f"attn_error_accumulated_{part}"] = [
                    math.sqrt(sp.err2[i] / sp.ref2[i]) for i in range(self.num_layers)
                ]
                out[f"vs_exact_{part}_only"] = paired_stats(
                    self._chunks(pn), self._chunks(ex.nll), n
                )
        if static and not variant.exact:
            out["attn_error_static"] = self.static_error(variant)
        if generation and self.gen_tokens:
            if self._exact_gen is None:
                self._exact_gen = self.greedy(None)
            toks = self.greedy(variant)
            same = [a == b for a, b in zip(toks, self._exact_gen, strict=True)]
            out["generation"] = {
                "tokens": len(toks),
                "identical_fraction": sum(same) / len(same),
                "first_divergence": next((i for i, s in enumerate(same) if not s), None),
            }
        out["seconds"] = time.time() - t0
        return out

    def external_result(
        self, name: str, token_nll: Sequence[float], bits_per_element: float, **extra: object
    ) -> dict:
        """A result row for per-token NLLs measured by another engine on the same ids (the
        hook for vLLM: ``prompt_logprobs`` of the kvarn plugin or of vLLM's fp8 cache), paired
        with this harness's exact-cache run. ``token_nll[i]`` is the NLL of ``ids[i + 1]``."""
        ex = self.exact()
        nll = torch.tensor(list(token_nll), dtype=torch.float64)
        if nll.shape != ex.nll.shape:
            raise ValueError(
                f"token_nll: expected {ex.nll.numel()} values (one per predicted token of the "
                f"{self.ids.shape[1]} ids), got {nll.numel()}"
            )
        return {
            "name": name,
            "method": name,
            "format": None,
            "sink": False,
            "bits_per_element": bits_per_element,
            "nll": float(nll.mean()),
            "ppl": math.exp(float(nll.mean())),
            "chunk_nll_sums": self._chunks(nll),
            "vs_exact": paired_stats(self._chunks(nll), self._chunks(ex.nll), nll.numel()),
            "attn_error_accumulated": [],
            **extra,
        }

    def exact_summary(self) -> dict:
        ex = self.exact()
        return {
            "name": "exact",
            "nll": float(ex.nll.mean()),
            "ppl": math.exp(float(ex.nll.mean())),
            "chunk_nll_sums": self._chunks(ex.nll),
            "tokens": ex.nll.numel(),
        }


def save_json(path: Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=1))
