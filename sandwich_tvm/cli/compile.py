"""`python -m sandwich_tvm.compile`: build the Relax Llama with Sandwich's kernels (cached)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from rich.console import Console

from ..compiler.artifact import compile_model
from .common import print_error
from .options import LOAD_ERRORS, add_model_args, spec_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandwich_tvm.compile",
                                description="Compile a Llama model through the 'sandwich' Relax pipeline: "
                                            "tuned kernel records for the plan's prefill and decode "
                                            "thread counts, default schedules elsewhere.")
    add_model_args(p)
    p.add_argument("--out", type=Path, default=None, help="artifact directory (default: the cache)")
    p.add_argument("--force", action="store_true", help="recompile even if a matching artifact exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        spec = spec_from_args(args, console.print)
        console.print(spec.plan.describe())
        compiled = compile_model(spec, out=args.out, force=args.force, log=console.print)
    except LOAD_ERRORS as exc:
        print_error(console, exc)
        return 2
    kinds = Counter(compiled.meta["kernels"].values())
    if kinds:
        console.print(f"Linear kernels: {kinds.get('tuned', 0)} tuned, {kinds.get('default', 0)} default "
                      "schedules (tune with `python -m sandwich_tvm.tune kernels`)")
    console.print(f"artifact: {compiled.path}")
    return 0
