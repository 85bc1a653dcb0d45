"""kimi-k3-serve: serve Kimi-K3 with Ray Serve and vLLM, and prove before launch that it fits.

The planner core (``models``, ``memory``, ``kvcache``, ``hardware``, ``planner``) imports no torch, vLLM or
Ray, so a capacity check answers in milliseconds anywhere. I/O lives at the edges (``cli``, ``app``,
``nvml``, ``cluster``).
"""

__version__ = "0.1.0"
