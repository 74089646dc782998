"""The run spec: what one run is built for, resolved once from the user's options and the host.

``resolve_run_spec`` is the one place where ``--dtype auto`` becomes a dtype
(``resolve_weight_dtype``), where the context and the KV cache are checked against the model
and the memory (``check_context``), and where the plan is read (only from a file the user
names). The frozen ``RunSpec`` it returns flows down to compile, the engine, the
tensor-parallel ranks, the simulator and tune; nothing below re-resolves it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .host import cpu_flags, isa_of
from .kernels.attention import DEFAULT_KV_DTYPE, KV_DTYPES
from .kernels.kv_int8 import row_width
from .kernels.microkernel import DTYPES, ISAS, kernel_isa
from .kernels.quant import BLOCK, QTYPES
from .model.config import LlamaConfig, load_config
from .model.llama import ACT_DTYPE
from .model.rope import at_context, uses_longrope
from .topology.plan import ExecPlan

WEIGHT_DTYPES = DTYPES  # what the micro-kernels read
DEFAULT_DTYPE = "auto"  # bfloat16 on every CPU (resolve_weight_dtype), as vLLM's --dtype auto serves 16 bits
DEFAULT_CONTEXT = 4096  # a server's longest request when the user does not say (capped at the model's)
CONTEXT_ROUND = 256  # a one-shot run's context is rounded up to this many tokens
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2,  # bytes a value (quantized: with the block's d, m)
               **{name: q.block_bytes / BLOCK for name, q in QTYPES.items()}}


class SpecError(ValueError):
    """Options that do not make a run on this model and host; the message names the option."""


def resolve_weight_dtype(choice: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """``(dtype, why)`` for a ``--dtype`` value. ``auto`` is bfloat16 on every CPU: computed on
    the bf16 unit where there is one (AMX, AVX512-BF16, Arm's BF16), else widened to fp32 as it
    is loaded, which still halves the bytes decode streams per token."""
    if choice != "auto":
        if choice not in WEIGHT_DTYPES:
            raise SpecError(f"weight dtype {choice!r} is not supported; use one of "
                            f"{', '.join(WEIGHT_DTYPES)} (or auto)")
        return choice, "as asked"
    flags = cpu_flags() if flags is None else flags
    isa = kernel_isa(isa_of(flags), "bfloat16", flags)
    if isa == "amx":
        return "bfloat16", ("this CPU has AMX: bf16 prefill GEMMs run on tdpbf16ps tiles, decode-sized "
                            "ones on AVX512-BF16's vdpbf16ps")
    if isa == "avx512bf16":
        return "bfloat16", "this CPU has AVX512-BF16: bf16 weights run on vdpbf16ps"
    if isa == "neonbf16":
        return "bfloat16", "this CPU has Arm's BF16 extension: bf16 weights run on bfdot"
    return "bfloat16", (f"this CPU has no bf16 dot-product unit the kernels use: bf16 weights are "
                        f"widened to fp32 on {isa} (half the weight bytes of fp32)")


ACTIVATIONS = ("auto", "int8", "float32")


def resolve_activations(choice: str, weight_dtype: str, flags: frozenset[str] | None = None) -> bool:
    """Whether quantized weights meet int8 activations (``--activations``): ``auto`` does where the
    CPU has an int8 dot-product unit (AVX512-VNNI, AVX-VNNI, AVX2's or AVX-512BW's vpmaddubsw, Arm
    dotprod; AMX), as llama.cpp does; ``float32`` keeps the fp32 activations and dequantizes the weights in
    registers (the weights' exact values: what HF transformers computes on the dequantized GGUF)."""
    if choice not in ACTIVATIONS:
        raise SpecError(f"--activations {choice!r} is not one of {', '.join(ACTIVATIONS)}")
    if weight_dtype not in QTYPES:
        if choice == "int8":
            raise SpecError(f"--activations int8 goes with quantized weights ({', '.join(QTYPES)}), not "
                            f"{weight_dtype}")
        return False
    flags = cpu_flags() if flags is None else flags
    unit = ISAS[kernel_isa(isa_of(flags), weight_dtype, flags)].quantized_unit
    if choice == "int8" and not unit:
        raise SpecError("--activations int8 needs an int8 dot-product unit (VNNI, Arm dotprod) this CPU "
                        "does not have; use --activations auto")
    return unit and choice != "float32"


REGROUPED_HOW = {"Q4_K": "every 4-bit value as it is, each block's scale and minimum rounded to fp16; 5 bits "
                         "a weight",
                 "Q5_0": "every value exactly; 8.5 bits a weight where the file holds 5.5"}


def gguf_auto_dtype(model: str | Path) -> tuple[str, str] | None:
    """What ``--dtype auto`` runs a GGUF's layers as, and why, where that is not the CPU's 16-bit
    default: its own q8_0/q4_0/q4_1 blocks as they are, Q4_K's regrouped as q4_1 blocks and
    Q5_0's as q8_0 ones (with the Linears the file holds in 5 bits or more in q8_0:
    ``model.gguf.wider_linears``); a type
    without kernels (Q5_1, the other K-quants) dequantized and re-rounded to q8_0, which keeps
    their values to within q8_0's rounding at about half the bytes of bf16."""
    from .model.config import model_path
    from .model.gguf import KERNEL_TYPES, NOTED_TYPES, WIDE_TYPES, layer_kinds

    path = model_path(model)
    if path.suffix != ".gguf":
        return None
    kinds = layer_kinds(path)
    kind = kinds.most_common(1)[0][0] if kinds else None
    own = KERNEL_TYPES.get(kind)
    if own is not None:
        others = {k: n for k, n in kinds.items() if KERNEL_TYPES.get(k) != own}
        wide = {k: n for k, n in others.items() if k in WIDE_TYPES} if own != "q8_0" else {}
        rounded = {k: n for k, n in others.items() if k not in wide}
        how = (f"the GGUF's own {own} blocks, loaded as they are" if kind.lower() == own else
               f"the GGUF's {kind} blocks run as {own} blocks ({REGROUPED_HOW.get(kind, 'their values')})")
        if wide:
            n = sum(wide.values())
            how += (f"; {n} layer {'matrix' if n == 1 else 'matrices'} in {', '.join(sorted(wide))} run in "
                    "q8_0 with the Linears that hold them, as wide as the file keeps them")
        if rounded:
            how += (f"; {sum(rounded.values())} of {sum(kinds.values())} layer matrices ("
                    f"{', '.join(sorted(rounded))}) are re-rounded to {own}")
        return own, how
    if kind in NOTED_TYPES:
        return "q8_0", (f"the GGUF's {kind} blocks have no kernels here: dequantized and re-rounded to "
                        "q8_0 (8.5 bits a weight) rather than widened to 16 bits; --dtype bfloat16 keeps "
                        "their values exactly")
    return None


def gguf_quant_type(model: str | Path) -> str | None:
    """A GGUF's quantized weight type where the kernels read it natively (``--dtype auto`` keeps it)."""
    from .model.config import model_path
    from .model.gguf import linear_type

    path = model_path(model)
    if path.suffix != ".gguf":
        return None
    kind = linear_type(path)
    return kind if kind in QTYPES else None


def _check_blocks(cfg: LlamaConfig, dtype: str, tp: int = 1) -> None:
    """Quantized weights need every Linear's k (hidden, attention and MLP widths) in blocks of 32,
    and so does each of ``tp`` tensor-parallel processes' share of the row-parallel ones."""
    if dtype not in QTYPES:
        return
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_attention_heads x head_dim": cfg.num_attention_heads * cfg.head_dim}
    for field, k in widths.items():
        if k % BLOCK:
            raise SpecError(f"--dtype {dtype} stores weights in blocks of {BLOCK} along k, but this model's "
                            f"{field} is {k}; use --dtype bfloat16")
        if tp > 1 and field != "hidden_size" and k % tp == 0 and (k // tp) % BLOCK:
            raise SpecError(f"--dtype {dtype} stores weights in blocks of {BLOCK} along k, but each of the "
                            f"plan's {tp} tensor-parallel processes would hold {k // tp} of {field} ({k}); "
                            "use a plan with fewer processes, or --dtype bfloat16")


def kv_value_bytes(kv_dtype: str, head_dim: int) -> float:
    """Bytes the cache takes per K or V value (int8: with its row's scale)."""
    return row_width(head_dim, kv_dtype) * (1 if kv_dtype == "int8" else DTYPE_BYTES[kv_dtype]) / head_dim


def kv_cache_bytes(cfg: LlamaConfig, tokens: int, kv_dtype: str = "float32") -> int:
    """K and V of every layer for ``tokens`` positions, stored as ``kv_dtype``."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    return round(per_token * kv_value_bytes(kv_dtype, cfg.head_dim) * tokens)


def run_context(cfg: LlamaConfig, needed: int) -> int:
    """The KV cache length for a one-shot run of ``needed`` tokens (prompt + new tokens): rounded
    up to ``CONTEXT_ROUND``, capped at the model's ``max_position_embeddings``."""
    rounded = -(-max(needed, 1) // CONTEXT_ROUND) * CONTEXT_ROUND
    return min(rounded, cfg.max_position_embeddings)


def check_context(cfg: LlamaConfig, tokens: int, *, option: str = "--context", kv_dtype: str = "float32",
                  available: int | None = None) -> None:
    """Raise ``SpecError`` when a KV cache of ``tokens`` is empty, longer than the model's context
    (for ``--context``) or would not fit in the memory available now (``available`` bytes;
    psutil's by default)."""
    if tokens < 1:
        raise SpecError(f"{option} {tokens} must be at least 1 token")
    if option == "--context" and tokens > cfg.max_position_embeddings:
        raise SpecError(f"{option} {tokens} exceeds the model's context of {cfg.max_position_embeddings} "
                        "tokens (max_position_embeddings, YaRN's longer one, or a window only some layers "
                        "slide over); lower it")
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    need = kv_cache_bytes(cfg, tokens, kv_dtype)
    if need > available:
        raise SpecError(f"a KV cache of {tokens} tokens needs {need / 2**30:.1f} GiB but only "
                        f"{available / 2**30:.1f} GiB of memory is available; lower {option}")


def layer_weight_bytes(cfg: LlamaConfig, weight_dtype: str,
                       wider: Sequence[tuple[int, str, str]] = ()) -> float:
    """Bytes a layer weight takes on average: ``DTYPE_BYTES[weight_dtype]``, more where Linears are
    held wider (``RunSpec.wider_linears``); what the simulator streams per weight."""
    from .model.shapes import linear_shapes

    shapes = linear_shapes(cfg, weight_dtype)
    extra = sum(shapes[name].n * shapes[name].k * (DTYPE_BYTES[dtype] - DTYPE_BYTES[weight_dtype])
                for _, name, dtype in wider)
    return DTYPE_BYTES[weight_dtype] + extra / (cfg.num_hidden_layers * cfg.layer_params())


def weights_bytes(cfg: LlamaConfig, weight_dtype: str, wider: Sequence[tuple[int, str, str]] = ()) -> int:
    """What a model's weights take once loaded: the layers' Linears in their type (``wider``:
    the (layer, Linear, dtype) held in another, ``RunSpec.wider_linears``), the head and an
    untied embedding table in the head's (q8_0 under 4-bit weights)."""
    from .kernels.quant import head_dtype

    tables = 1 if cfg.tie_word_embeddings else 2
    layers = cfg.num_hidden_layers * cfg.layer_params()
    return int(layers * layer_weight_bytes(cfg, weight_dtype, wider)
               + tables * cfg.vocab_size * cfg.hidden_size * DTYPE_BYTES[head_dtype(weight_dtype)])


def check_weights_fit(spec: RunSpec, available: int | None = None) -> None:
    """Raise ``SpecError`` when the weights and the KV cache would not fit in the memory
    available now (psutil's), before anything is compiled or converted; stages on other hosts
    hold their own share there."""
    if spec.hosts:
        return
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    dtype = "float32" if spec.stock else spec.weight_dtype
    weights = weights_bytes(spec.config, dtype, spec.built_wider)
    kv = kv_cache_bytes(spec.config, spec.kv_tokens, spec.kv_dtype)
    if weights + kv > available:
        smaller = "" if spec.stock or dtype in ("q4_0", "q4_1") else ", a smaller --dtype (q8_0, q4_0)"
        which = f"{dtype} weights (TVM's stock build)" if spec.stock else f"{dtype} weights"
        raise SpecError(f"{spec.config.name}'s {which} take {weights / 2**30:.1f} GiB and its KV cache "
                        f"{kv / 2**30:.1f} GiB, but only {available / 2**30:.1f} GiB of memory is available; "
                        f"use a machine with more memory{smaller} or a smaller --context")


@dataclass(frozen=True)
class RunSpec:
    """Everything a run is compiled and served for. ``model`` is what weights load from (a preset
    name or a checkpoint directory); ``config`` describes that checkpoint only."""

    model: str
    config: LlamaConfig
    plan: ExecPlan
    weight_dtype: str = "float32"
    kv_dtype: str = DEFAULT_KV_DTYPE
    act_dtype: str = ACT_DTYPE
    context: int = 2048  # the longest sequence, prompt + output
    kv_tokens: int = 2048  # the paged KV cache, shared by up to max_batch sequences
    max_batch: int = 8  # sequences at once; the decode kernels' largest m
    prefill_chunk: int = 2048  # the most tokens one prefill call takes
    records: Path | None = None  # None: the user's records directory, then the shipped ones
    stock: bool = False  # TVM's own build (nn.Linear, its pipeline): the baseline
    seed: int = 0  # a preset's random weights
    dtype_note: str = ""  # why --dtype auto chose weight_dtype
    int8_activations: bool = False  # quantized weights times int8 activations (llama.cpp's way)
    hosts: tuple[str, ...] = ()  # workers (HOST:PORT) that run pipeline stages 1.. (stage 0 runs here)
    host_timeout_s: float = 60.0  # a host that answers no call within this fails it
    imatrix: Path | None = None  # an importance matrix that 4-bit weights quantized at load follow
    # (layer, Linear, dtype): Linears a GGUF holds wider than weight_dtype (a Q4_K_M's Q6_K attn_v
    # and ffn_down), run in that dtype under --dtype auto (``model.gguf.wider_linears``)
    wider_linears: tuple[tuple[int, str, str], ...] = ()

    def __post_init__(self) -> None:
        # what the context decides in the model: LongRoPE's factor set (``model.rope.at_context``)
        object.__setattr__(self, "config", at_context(self.config, self.context))

    @property
    def built_wider(self) -> tuple[tuple[int, str, str], ...]:
        """The wider Linears the build runs: ``wider_linears``, none in TVM's stock build."""
        return () if self.stock else self.wider_linears

    def describe(self) -> str:
        acts = ", int8 activations" if self.int8_activations else ""
        acts += f", imatrix {self.imatrix.name}" if self.imatrix else ""
        wide = f" ({len(self.wider_linears)} Linears in q8_0)" if self.wider_linears else ""
        build = ("TVM stock build" if self.stock
                 else f"{self.weight_dtype} weights{wide}{acts}, {self.kv_dtype} KV cache")
        rope = ""
        if uses_longrope(self.config):
            rope = f" (LongRoPE's {'long' if self.config.rope_scaling.get('long') else 'short'} factors)"
        if self.config.sliding_window:
            rope += f", sliding window {self.config.sliding_window}"
        return (f"{self.config.name}: {build}, context {self.context}{rope}, KV cache {self.kv_tokens} "
                f"tokens, batch {self.max_batch}; {self.plan.describe()}")

    def with_plan(self, plan: ExecPlan) -> RunSpec:
        return replace(self, plan=plan)

    def to_json(self) -> str:
        """For the tensor-parallel ranks: everything but the config, which they reload from ``model``."""
        d = asdict(self)
        d.pop("config")
        d["plan"] = self.plan.to_dict()
        d["records"] = None if self.records is None else str(self.records)
        d["imatrix"] = None if self.imatrix is None else str(self.imatrix)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        d = json.loads(text)
        d["plan"] = ExecPlan.from_dict(d["plan"], d["plan"].get("source", "run spec"))
        d["records"] = None if d["records"] is None else Path(d["records"])
        d["imatrix"] = None if d.get("imatrix") is None else Path(d["imatrix"])
        d["hosts"] = tuple(d.get("hosts", ()))
        d["wider_linears"] = tuple(tuple(w) for w in d.get("wider_linears", ()))
        return cls(config=load_config(d["model"]), **d)


def resolve_run_spec(model: str | Path, *, dtype: str = DEFAULT_DTYPE, kv_dtype: str = DEFAULT_KV_DTYPE,
                     activations: str = "auto",
                     plan: ExecPlan | Path | None = None, context: int | None = None,
                     needed_tokens: int | None = None, kv_tokens: int | None = None,
                     shared_kv: bool = False, max_batch: int = 8, prefill_chunk: int = 2048,
                     records: Path | None = None, stock: bool = False, seed: int = 0,
                     hosts: str | Sequence[str] = (), host_timeout_s: float = 60.0,
                     imatrix: Path | str | None = None,
                     log: Callable[[str], None] = lambda _m: None) -> RunSpec:
    """The run spec of these options on this host, checked before anything is compiled or loaded.

    ``plan``: an ``ExecPlan``, a plans.json the user named, or None for every CPU. ``context``:
    the user's ``--context`` (checked against the model); without it, ``needed_tokens`` (a
    one-shot run's prompt + new tokens, rounded up) or ``DEFAULT_CONTEXT``, capped at the
    model's. ``kv_tokens``: the cache's size; default ``context``, or with ``shared_kv`` (a
    server) half of ``context x max_batch``. TVM's stock build runs fp32 weights and cache.
    ``hosts``: workers that run pipeline stages 1.. (``HOST:PORT,...``; stage 0 runs here).
    ``imatrix``: an importance matrix file for 4-bit weights quantized at load."""
    cfg = load_config(model)
    if kv_dtype not in KV_DTYPES:
        raise SpecError(f"KV cache dtype {kv_dtype!r} is not supported; use one of {', '.join(KV_DTYPES)}")
    wider: tuple[tuple[int, str, str], ...] = ()
    if stock:
        weight_dtype, note, kv_dtype = "float32", "TVM's stock build", "float32"
    else:
        weight_dtype, note = resolve_weight_dtype(dtype)
        own = gguf_auto_dtype(model) if dtype == "auto" else None
        if own is not None:
            weight_dtype, note = own
            if weight_dtype in ("q4_0", "q4_1"):  # what the file holds in 5 bits or more stays q8_0
                from .model.config import model_path
                from .model.gguf import wider_linears

                wider = wider_linears(model_path(model))
    int8_acts = False if stock else resolve_activations(activations, weight_dtype)
    imatrix = _check_imatrix(imatrix, model, cfg, weight_dtype, stock)
    if plan is None:
        plan = ExecPlan.all_cpus()
    elif not isinstance(plan, ExecPlan):
        plan = ExecPlan.from_file(Path(plan))
    hosts = _check_hosts(hosts, plan)
    if not stock:
        _check_blocks(cfg, weight_dtype, plan.tp)
    if context is not None:
        check_context(cfg, context, kv_dtype=kv_dtype)
    elif needed_tokens is not None:
        context = run_context(cfg, needed_tokens)
    else:
        context = min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
    default_kv = max(context * max_batch // 2, context) if shared_kv else context
    kv = max(kv_tokens or default_kv, context)
    check_context(cfg, kv, option="--kv-cache-tokens" if kv_tokens or shared_kv else "--context",
                  kv_dtype=kv_dtype)
    if dtype == "auto" and not stock:  # once every option checked out: an error stays one line
        log(f"weights: {weight_dtype} ({note})")
    return RunSpec(model=str(model), config=cfg, plan=plan, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                   context=context, kv_tokens=kv, max_batch=max_batch,
                   prefill_chunk=min(prefill_chunk, context), records=records, stock=stock, seed=seed,
                   dtype_note=note, int8_activations=int8_acts, hosts=hosts, host_timeout_s=host_timeout_s,
                   imatrix=imatrix, wider_linears=wider)


def _check_imatrix(imatrix: Path | str | None, model: str | Path, cfg: LlamaConfig, weight_dtype: str,
                   stock: bool) -> Path | None:
    """The importance matrix file, read once here so that a bad one is an error before compiling;
    refused where no weight is rounded at load (it would change nothing)."""
    if not imatrix:
        return None
    if stock or weight_dtype not in ("q4_0", "q4_1"):
        raise SpecError(f"--imatrix weighs the rounding of 4-bit weights; these are {weight_dtype}: use "
                        "--dtype q4_0 or q4_1, or drop --imatrix")
    if gguf_quant_type(model) == weight_dtype:
        raise SpecError(f"--imatrix: the GGUF's own {weight_dtype} blocks load as they are, rounded already; "
                        f"drop --imatrix, or ask for the other 4-bit type (--dtype "
                        f"{'q4_1' if weight_dtype == 'q4_0' else 'q4_0'})")
    from .model.imatrix import read_imatrix

    read_imatrix(imatrix, cfg)
    return Path(imatrix).resolve()


def _check_hosts(hosts: str | Sequence[str], plan: ExecPlan) -> tuple[str, ...]:
    """``hosts`` as ``HOST:PORT`` strings, one per pipeline stage after the first."""
    from .topology.hosts import HostError, parse_hosts

    if not hosts:
        return ()
    try:
        parsed = parse_hosts(hosts if isinstance(hosts, str) else ",".join(hosts))
    except HostError as err:
        raise SpecError(str(err)) from None
    if plan.wa:
        raise SpecError("--hosts runs pipeline stages on other hosts; weight-attention separation runs on "
                        "one host in this version (use a plan without \"wa\")")
    if plan.tp != 1 or plan.pp != 1 + len(parsed):
        raise SpecError(f"--hosts names {len(parsed)} host(s): the plan must have {1 + len(parsed)} pipeline "
                        f"stages of one process each (stage 0 runs here, one stage on each host); it has "
                        f"{plan.pp} stage(s) of {plan.tp} process(es)")
    return tuple(str(h) for h in parsed)
