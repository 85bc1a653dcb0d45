"""Rehearse a deployment on vLLM's real engine with dummy weights, and compare what vLLM measured with the plan.

- ``slicing``: a Kimi-K3 slice of N layers that keeps every layer kind (dense, MoE, KDA, MLA, MXFP4 experts), and
  the draft to go with it;
- ``vllm_log``: reads what vLLM 0.32 logged (memory profile, KV cache, CUDA graphs, an OOM and its step);
- ``compare``: the plan's per-GPU prediction beside vLLM's measurement, and the verdicts of both;
- ``runner``: the child process that starts vLLM (the only module here that imports vLLM).
"""
