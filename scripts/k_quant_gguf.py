"""A model as a llama.cpp K-quant GGUF (Q4_K_M by default), made as llama.cpp users make theirs:
a preset's random weights as an F16 GGUF (``bench.baselines.llamacpp.gguf_for``), or a packaged
model's own GGUF (SmolLM2's Q4_1, its tokenizer kept), through ``llama-quantize`` (``bash
scripts/build_llama_server.sh`` builds it). ``bench e2e`` or ``bench perplexity --llamacpp``
with ``--model FILE`` then runs both systems on that one file:

    .venv/bin/python scripts/k_quant_gguf.py --model llama-3.2-1b --out out/llama-3.2-1b-q4_k_m.gguf
    .venv/bin/python scripts/k_quant_gguf.py --model smollm2-135m --out out/smollm2-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    from sandwich_tvm.bench.baselines.llama_quantize import LlamaToolError, requantize
    from sandwich_tvm.bench.baselines.llamacpp import gguf_for
    from sandwich_tvm.model.config import NAMED_MODELS, PRESETS, load_config, model_path
    from sandwich_tvm.model.gguf import layer_kinds

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(PRESETS) + sorted(NAMED_MODELS))
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name (default Q4_K_M)")
    parser.add_argument("--seed", type=int, default=0, help="the preset's weights (default 0)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    src = (model_path(args.model) if args.model in NAMED_MODELS
           else gguf_for(args.model, load_config(args.model), args.seed, log=print, dtype="float16"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        cmd = requantize(src, args.out, args.type, threads=len(os.sched_getaffinity(0)))
    except LlamaToolError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(" ".join(cmd))
    print(f"{args.out}: {dict(layer_kinds(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
