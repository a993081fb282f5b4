"""Accuracy evaluation of KV-cache formats on real models (the ``kvarn-eval`` console script).

Needs the ``eval`` extra (transformers, gguf, accelerate, matplotlib, tqdm); not imported by
``import kvarn_ops``. Modules: ``model_setup`` (SmolLM2-135M offline, tiny test model),
``variants`` (the cache formats compared), ``attention`` (attention over a cache evolving as in
serving), ``harness`` (PPL, attention error, greedy agreement), ``report``, ``cli``.
"""
