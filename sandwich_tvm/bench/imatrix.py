"""`python -m sandwich_tvm.bench imatrix`: an importance matrix for a GGUF model, made by
llama.cpp's ``llama-imatrix`` over ShareGPT text the perplexity benchmark does not score.

The calibration text is ShareGPT's conversations after the first ``--skip-chars`` characters
(default a million; ``bench perplexity`` scores the first ``8 x --tokens``), so an importance
matrix is never fitted to the text it is judged on. Use the file with ``--imatrix`` on
``generate``/``serve``/``compile`` or ``bench perplexity --imatrix``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from ..cli.args import positive_int

SKIP_CHARS = 1_000_000


def add_imatrix_parser(sub) -> None:
    from ..model.config import DEFAULT_MODEL

    p = sub.add_parser("imatrix", help="an importance matrix for a GGUF model, by llama-imatrix on ShareGPT")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"a GGUF model (default {DEFAULT_MODEL})")
    p.add_argument("--out", type=Path, required=True, help="the importance matrix file to write (.gguf)")
    p.add_argument("--chunks", type=positive_int, default=64, help="chunks of --window tokens (default 64)")
    p.add_argument("--window", type=positive_int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--skip-chars", type=positive_int, default=SKIP_CHARS,
                   help=f"ShareGPT characters left for the perplexity benchmark (default {SKIP_CHARS})")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a line")


def main_imatrix(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..host import host_signature
    from ..model.config import ModelConfigError, model_path
    from ..topology.plan import ExecPlan
    from .baselines.llama_quantize import LlamaToolError, make_imatrix
    from .perplexity import sharegpt_text

    try:
        path = model_path(args.model)
        if path.suffix != ".gguf":
            raise ValueError(f"llama-imatrix reads a GGUF file; {args.model!r} is {path}, not a .gguf")
        if args.out.suffix != ".gguf":
            raise ValueError(f"--out {args.out}: name it .gguf (llama-imatrix writes its GGUF form then)")
        text = sharegpt_text(args.chunks * args.window * 8, skip=args.skip_chars)
    except (ValueError, ModelConfigError) as exc:
        print_error(console, exc)
        return 2
    threads = ExecPlan.all_cpus().prefill_threads
    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    log(f"llama-imatrix on {path.name}: {args.chunks} chunks of {args.window} tokens of "
                  f"ShareGPT after its first {args.skip_chars} characters, {threads} threads ...")
    try:
        command, seconds = make_imatrix(path, text, args.out, n_ctx=args.window, chunks=args.chunks,
                                        threads=threads)
    except LlamaToolError as exc:
        print_error(console, exc)
        return 2
    out = {"out": str(args.out), "model": path.name, "cpu": host_signature().slug, "seconds": seconds,
           "calibration": f"ShareGPT after {args.skip_chars} characters", "command": command}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        console.print(f"wrote {args.out} in {seconds:.0f} s: use it with --imatrix {args.out}")
    return 0
