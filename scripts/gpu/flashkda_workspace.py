"""FlashKDA's kernel workspace over a grid of shapes, read from the kernel library itself, as JSON (GPU host).

vLLM 0.32's Kimi-K3 KDA layer (``models/kimi_k3/nvidia/kda.py``) asks its shared workspace for a (1, T, H, D) output,
two (N, H, D, D) recurrent states and ``torch.ops._flashkda_C.get_workspace_size(T, H, N)`` bytes, with T =
max_num_batched_tokens, H the rank's KDA heads and N = max_num_seqs. That last size is a C++ function of the
compiled library, which only the GPU bundle's vLLM has: this reads it at the shapes a deployment can take, so the
plan can carry the library's own numbers instead of a share fitted on one run.

    python3 scripts/gpu/flashkda_workspace.py OUT.json      # after host_setup.sh
"""

from __future__ import annotations

import itertools
import json
import sys

TOKENS = (1, 63, 64, 65, 127, 128, 129, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 32768)
HEADS = (1, 2, 12, 24, 48, 96)
SEQS = (1, 2, 3, 16, 32, 64, 128, 256, 512, 768, 1024)


def main(argv: list[str]) -> int:
    import torch
    import vllm._flashkda_C  # noqa: F401  (registers torch.ops._flashkda_C)

    size = torch.ops._flashkda_C.get_workspace_size
    rows = [{"T": t, "H": h, "N": n, "bytes": int(size(t, h, n))} for t, h, n in itertools.product(TOKENS, HEADS, SEQS)]
    with open(argv[0], "w") as f:
        json.dump({"function": "torch.ops._flashkda_C.get_workspace_size(T, H, N)", "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "rows": rows}, f)
    print(f"{len(rows)} shapes; T=8192 H=96 N=1024: {size(8192, 96, 1024):,} B")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
