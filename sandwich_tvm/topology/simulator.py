"""Trace-driven latency simulator: predicted TTFT and TPOT of a service configuration.

Per decoder layer and process, a roofline: GEMM/GEMV time is the larger of FLOPs over the
process's compute and bytes over its memory bandwidth; attention adds its FLOPs (prefill)
or its KV-cache bytes (decode). Bandwidth comes from the machine's shared resources: every
resource instance (NUMA node, L3, latent cluster) splits what it delivers with k active
cores among them, so all processes running at once contend. Tensor parallelism adds two
all-reduces per layer over shared memory, slower when processes span NUMA nodes. Pipeline
stages run their own layers one after the other for one request (decode at batch 1: each stage
alone on the machine), a prompt in pieces that overlap stage by stage (the runtime's
micro-batches: fill, then the slowest stage per piece), and every hand-off between stages
costs the collective's latency and bandwidth. Stages on other hosts (``ServiceConfig.hosts``)
pay the network instead (``HopCost``, measured by ``bench hop``): a round trip to every host per
exchange of the controller's relay (``runtime.relay``) and one to start the step, carrying the
hidden states there and back (the head runs on the first stage, so no logits cross).
Weight-attention separation (``ServiceConfig.wa``) runs each layer's weight-centric operators on
the weight side and its attention on the attention rank, one after the other, with two hand-offs
per layer (the fused QKV there, the attention output back), each reading its own memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..model.config import LlamaConfig
from ..model.stages import MIN_PIECE, Stage, split_layers
from .configs import ServiceConfig
from .profile import MachineProfile, Resource
from .tree import TopoTree

LLC_FIT = 0.75  # weights up to this share of the last-level caches are served from them

ACT_BYTES = 4  # the all-reduces carry activations and logits, which stay fp32 whatever the weights' dtype


@dataclass(frozen=True)
class HopCost:
    """One hop between the controller and a worker host: a Disco call's latency, and the
    bandwidth of the bytes it carries (``bench hop``'s JSON)."""

    latency_us: float
    gbs: float

    @classmethod
    def from_json(cls, raw: dict) -> HopCost:
        if not raw.get("gbs") or raw.get("latency_us") is None:
            raise ValueError("the hop measurement has no latency or bandwidth: rerun `bench hop`")
        return cls(float(raw["latency_us"]), float(raw["gbs"]))

    def ms(self, hops: np.ndarray | float, nbytes: np.ndarray | float) -> np.ndarray:
        return np.asarray(hops, float) * self.latency_us / 1e3 + np.asarray(nbytes, float) / (self.gbs * 1e6)


@dataclass(frozen=True)
class DecodeKernels:
    """What a process's decode GEMMs take at m = 1 as their tuning measured them (cold weights,
    one process alone): every Linear of one layer, and the head (ms). A model whose weights
    stream faster than its kernels compute (small, quantized) is bound by these, not by the
    bandwidth roof."""

    layer_ms: float
    head_ms: float


@dataclass(frozen=True)
class Trace:
    """Request lengths (tokens) the simulator replays."""

    prompt: np.ndarray
    output: np.ndarray

    def __post_init__(self) -> None:
        if len(self.prompt) == 0 or len(self.prompt) != len(self.output):
            raise ValueError("a trace needs as many prompt lengths as output lengths, at least one")

    def __hash__(self) -> int:
        return hash((self.prompt.tobytes(), self.output.tobytes()))


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float  # mean over the trace
    tpot_ms: float  # token-weighted mean over the trace
    decode_ms: float  # mean per request: output tokens x TPOT

    @property
    def latency_ms(self) -> float:
        return self.ttft_ms + self.decode_ms


class LatencySimulator:
    """Predicts TTFT/TPOT for configurations on one machine, model and trace."""

    def __init__(self, tree: TopoTree, profile: MachineProfile, model: LlamaConfig, trace: Trace, *,
                 weight_bytes: float = 4, kv_bytes: float = 4, hop: HopCost | None = None,
                 decode_kernels: dict[int, DecodeKernels] | None = None, head_bytes: float | None = None):
        """``weight_bytes`` / ``kv_bytes``: bytes per weight and per cached K/V element (the run
        spec's weight and KV dtypes); ``head_bytes``: per lm_head weight, where its type differs
        (q8_0 under 4-bit weights; default ``weight_bytes``); ``hop``: the network's, for stages on
        other hosts; ``decode_kernels``: per thread count, the decode GEMMs' own measured times (a floor under
        the roofline for an unsharded process of that many threads)."""
        self.profile, self.model, self.trace, self.hop = profile, model, trace, hop
        self.decode_kernels = decode_kernels or {}
        self.weight_bytes, self.kv_bytes = weight_bytes, kv_bytes
        self.head_bytes = weight_bytes if head_bytes is None else head_bytes
        self._instance = {r.name: _instances(tree, r) for r in profile.resources}
        core_depth = tree.depth_of("Core")
        self._core_of = _by_node(tree, core_depth) if core_depth is not None else {}
        l3_depth = tree.depth_of("L3Cache")
        self._l3_of = _by_node(tree, l3_depth) if l3_depth is not None else {}
        self._l3_size = (tree.levels[l3_depth].cache_size or 0) if l3_depth is not None else 0
        self._memo: dict[tuple, np.ndarray] = {}

    # ---- roofs of one configuration -------------------------------------------------
    def compute_gflops(self, config: ServiceConfig) -> float:
        """Peak GFLOPS of one process (SMT siblings share a core)."""
        proc = config.processes[0]
        per_core: dict[int, int] = {}
        for pu in proc:
            core = self._core_of.get(pu, pu)
            per_core[core] = per_core.get(core, 0) + 1
        gain = sum(self.profile.smt_gain if n > 1 else 1.0 for n in per_core.values())
        return gain * self.profile.gflops_per_core

    def bandwidth_gbs(self, config: ServiceConfig, resident: float | None = None) -> float:
        """Memory bandwidth of the slowest process while all processes stream; ``resident``: the
        bytes each process reads (default its share of the weights), served from the LLC when
        they fit."""
        active: dict[tuple[str, int], int] = {}
        for pu in config.cpus():
            for name, inst in self._instance.items():
                active[name, inst[pu]] = active.get((name, inst[pu]), 0) + 1
        resources = {r.name: r for r in self.profile.resources}
        worst = float("inf")
        for proc, domains in zip(config.processes, config.domains, strict=True):
            bw = 0.0
            for pu in proc:
                shares = []
                for name, inst in self._instance.items():
                    k = active[name, inst[pu]]
                    shares.append(resources[name].bandwidth(k) / k)
                bw += min(shares)
            if len(domains) > 1:  # weights spread over k nodes: (k-1)/k of reads are remote
                local = 1 / len(domains)
                bw /= local + (1 - local) / self.profile.remote_factor
            worst = min(worst, bw)
        weights = self.weights_per_process(config) if resident is None else resident
        if self.profile.llc_gbs_per_core and weights <= LLC_FIT * self.llc_bytes(config):
            worst = max(worst, self.profile.llc_gbs_per_core * config.threads)
        return worst

    def _bandwidth_each(self, config: ServiceConfig, resident: np.ndarray) -> np.ndarray:
        """``bandwidth_gbs`` for each of an array of resident byte counts (a cache per context
        length: the short ones may fit the LLC while the long ones stream from DRAM)."""
        resident = np.asarray(resident, dtype=float)
        fits = resident <= LLC_FIT * self.llc_bytes(config)
        llc, dram = self.bandwidth_gbs(config, resident=0.0), self.bandwidth_gbs(config, resident=math.inf)
        return np.where(fits, llc, dram)

    def llc_bytes(self, config: ServiceConfig) -> float:
        proc = config.processes[0]
        l3s = {self._l3_of.get(pu) for pu in proc}
        sharers = {inst: sum(1 for p in config.processes
                             if any(self._l3_of.get(pu) == inst for pu in p)) for inst in l3s}
        return sum(self._l3_size / sharers[inst] for inst in l3s)

    def _allreduce_ms(self, config: ServiceConfig, nbytes: np.ndarray | float) -> np.ndarray:
        p = config.tp
        if p == 1:
            return np.zeros_like(np.asarray(nbytes, dtype=float))
        one_node = len({d for ds in config.domains for d in ds}) == 1
        latency = self.profile.allreduce_latency_us if one_node else self.profile.allreduce_cross_numa_us
        gbs = self.profile.allreduce_gbs * (1.0 if one_node else self.profile.remote_factor)
        return latency / 1e3 + 2 * (p - 1) / p * np.asarray(nbytes, float) / (gbs * 1e6)

    def _handoff_ms(self, config: ServiceConfig, nbytes: np.ndarray | float) -> np.ndarray:
        """A separated layer's two hand-offs (``nbytes`` both ways together) between its sides:
        the all-reduce's latency each, across NUMA nodes when the sides' memory differs."""
        p = self.profile
        one_node = len({d for ds in config.domains for d in ds}) == 1
        latency = p.allreduce_latency_us if one_node else p.allreduce_cross_numa_us
        gbs = p.allreduce_gbs * (1.0 if one_node else p.remote_factor)
        return 2 * latency / 1e3 + np.asarray(nbytes, float) / (gbs * 1e6)

    def _hop_ms(self, nbytes: np.ndarray | float) -> np.ndarray:
        """One hand-off between pipeline stages: the collective's latency plus the bytes."""
        p = self.profile
        return p.allreduce_latency_us / 1e3 + np.asarray(nbytes, float) / (p.allreduce_gbs * 1e6)

    def _pipeline_ms(self, config: ServiceConfig, tokens: np.ndarray, decode: bool, batch: int = 1
                     ) -> np.ndarray:
        """A prefill (``tokens``: prompt lengths) or a decode step of ``batch`` sequences
        (``tokens``: context lengths) through ``config``'s stages, as ``runtime.stage`` runs it:
        a prompt in up to ``pp`` pieces, a decode batch in up to ``pp`` micro-batches, in flight
        one tick apart (each stage reads its weights once per micro-batch). A decode stage's
        bandwidth is its own: right for a socket a stage, optimistic for stages that share a
        memory domain while several micro-batches stream at once."""
        m = self.model
        stages = split_layers(m.num_hidden_layers, config.pp)
        n = np.asarray(tokens, dtype=float)
        pieces = np.full_like(n, float(min(config.pp, batch))) if decode else np.where(
            n >= 2 * MIN_PIECE, np.minimum(config.pp, np.floor(n / MIN_PIECE)), 1)
        per_piece = n / pieces
        micro = -(-batch // min(config.pp, batch))  # the largest micro-batch sets a tick
        times = []
        for i, stage in enumerate(stages):
            # decode: each stage alone on its cores, a micro-batch at a time; prompt pieces overlap,
            # every stage streaming at once (and a piece attends to the pieces before it)
            sub = config.stage(i) if decode else config
            # a stage reads (and may keep in its LLC) only its own layers' weights, the head too on the first
            resident = self.stage_bytes(stage, sub.tp) if decode else None
            layer = (self._decode_layer_ms(sub, n, resident, micro, stage.layers) if decode
                     else self._prefill_layer_ms(sub, per_piece, (n + per_piece) / 2))
            t = stage.layers * layer
            if stage.first:  # the head is on the first stage, with the embedding
                t = t + (self._decode_head_ms(sub, resident, micro) if decode else self._prefill_head_ms(sub))
            times.append(t)
        stacked = np.stack(times)
        ticks = pieces + config.pp - 1
        hidden = (micro if decode else per_piece) * m.hidden_size * ACT_BYTES
        compute = stacked.sum(axis=0) + (pieces - 1) * stacked.max(axis=0)
        if config.hosts:
            if self.hop is None:
                raise ValueError("stages on other hosts need the network's hop cost: run `bench hop`")
            # a call per exchange (a hand-off per tick but the last, the last stage's rows back to
            # the first stage's head per wanted part) and one to start, each a round trip to every host;
            # bytes: the remote stages' hidden states up (the first stage's are in-process, the
            # last stage hands none on), every stage's block but the last down to every host
            p = config.pp
            rows = m.hidden_size * ACT_BYTES
            wanted = pieces if decode else 1  # a prompt's pieces: only the last one's row comes back
            moved = (ticks - 1) * hidden * (p - 2 + (p - 1) ** 2) + wanted * rows * (micro if decode else 1)
            return compute + self.hop.ms((ticks - 1 + wanted + 1) * (p - 1), moved)
        # the last stage's rows to the first stage's head: each micro-batch's, one row of a prompt
        last = (micro if decode else 1) * m.hidden_size * ACT_BYTES
        return compute + (ticks - 1) * self._hop_ms(hidden) + (pieces if decode else 1) * self._hop_ms(last)

    def _separated_ms(self, config: ServiceConfig, tokens: np.ndarray, decode: bool) -> np.ndarray:
        """A prefill (``tokens``: prompt lengths) or a batch-1 decode step (context lengths) of a
        weight-attention separated model: per layer the weight side's GEMMs, then attention on
        the attention rank, with the QKV and the attention output handed over between them."""
        m, b = self.model, self.weight_bytes
        weights, attention = config.side(0), config.side(1)
        n = np.asarray(tokens, dtype=float)
        rows = np.ones_like(n) if decode else n  # tokens through the layer's GEMMs
        w_gemm = self.compute_gflops(weights) * 1e6 * self.profile.gemm_efficiency
        w_bw = self.bandwidth_gbs(weights) * 1e6
        gemms = np.maximum(2 * rows * m.layer_params() / w_gemm, m.layer_params() * b / w_bw)
        if decode and (kernels := self._kernels(weights)) is not None:
            gemms = np.maximum(gemms, kernels.layer_ms)
        a_peak = self.compute_gflops(attention) * 1e6
        heads, d = m.num_attention_heads, m.head_dim
        kv = 2 * n * m.num_key_value_heads * d * self.kv_bytes  # one layer's cache
        a_bw = self._bandwidth_each(attention, kv * m.num_hidden_layers) * 1e6
        if decode:
            attend = np.maximum(kv / a_bw, 4 * n * heads * d / (a_peak * self.profile.gemm_efficiency))
        else:
            attend = 2 * n * n * heads * d / (a_peak * self.profile.attention_efficiency)
        width = (heads + 2 * m.num_key_value_heads) * d
        hops = self._handoff_ms(config, rows * (width + heads * d) * ACT_BYTES)
        layer = gemms + attend + hops + self.profile.layer_overhead_us / 1e3
        head = self._decode_head_ms(weights) if decode else self._prefill_head_ms(weights)
        return m.num_hidden_layers * layer + head

    # ---- phases ---------------------------------------------------------------------
    def _prefill_layer_ms(self, config: ServiceConfig, s: np.ndarray, context: np.ndarray | None = None
                          ) -> np.ndarray:
        """One layer over ``s`` new tokens (attending to ``context`` positions, default ``s``)."""
        m, tp, b = self.model, config.tp, self.weight_bytes
        ctx = s if context is None else context
        peak = self.compute_gflops(config) * 1e6  # FLOP per ms
        gemm, attn = peak * self.profile.gemm_efficiency, peak * self.profile.attention_efficiency
        bw = self.bandwidth_gbs(config) * 1e6  # bytes per ms
        layer = np.maximum(2 * s * m.layer_params() / tp / gemm, m.layer_params() * b / tp / bw)
        layer += 2 * s * ctx * m.num_attention_heads * m.head_dim / tp / attn
        layer += 2 * self._allreduce_ms(config, s * m.hidden_size * ACT_BYTES)
        return layer + self.profile.layer_overhead_us / 1e3

    def _prefill_head_ms(self, config: ServiceConfig) -> float:
        m, tp, b = self.model, config.tp, self.head_bytes
        gemm = self.compute_gflops(config) * 1e6 * self.profile.gemm_efficiency
        bw = self.bandwidth_gbs(config) * 1e6
        head = max(2 * m.hidden_size * m.vocab_size / tp / gemm, m.hidden_size * m.vocab_size * b / tp / bw)
        return head + float(self._allreduce_ms(config, m.vocab_size * ACT_BYTES / tp))

    def weights_per_process(self, config: ServiceConfig) -> float:
        """The weight bytes each process reads per decode step: its share of every layer and of
        the head (in its own type); the input embedding is one row a token, not counted."""
        layers = self.model.num_hidden_layers
        return self.stage_bytes(Stage(0, 1, 0, layers), len(config.processes))  # the whole model, one stage

    def stage_bytes(self, stage: Stage, tp: int) -> float:
        """The weight bytes one rank of a pipeline stage reads per decode step."""
        m = self.model
        head = m.hidden_size * m.vocab_size * self.head_bytes if stage.first else 0.0
        return (stage.layers * m.layer_params() * self.weight_bytes + head) / tp

    def _decode_layer_ms(self, config: ServiceConfig, ctx: np.ndarray, resident: float | None = None,
                         batch: int = 1, layers: int | None = None) -> np.ndarray:
        """One layer of a decode step of ``batch`` sequences (the weights read once, each
        sequence's cache its own). ``resident``: the weight bytes each process reads per step
        (default ``weights_per_process``), served from the LLC when they fit; the cache of the
        ``layers`` this process runs (default all) is served from it only when weights and cache
        fit together, else from DRAM (weights read every step stay, the cache streams)."""
        m, tp, b = self.model, config.tp, self.weight_bytes
        gemm = self.compute_gflops(config) * 1e6 * self.profile.gemm_efficiency
        weights = self.weights_per_process(config) if resident is None else resident
        bw = self.bandwidth_gbs(config, weights) * 1e6
        kv = batch * 2 * ctx * m.num_key_value_heads * m.head_dim * self.kv_bytes / tp
        kv_bw = self._bandwidth_each(config, weights + (layers or m.num_hidden_layers) * kv) * 1e6
        flops = batch * (2 * m.layer_params() / tp + 4 * ctx * m.num_attention_heads * m.head_dim / tp)
        layer = np.maximum(m.layer_params() * b / tp / bw + kv / kv_bw, flops / gemm)
        if (kernels := self._kernels(config)) is not None:  # m = 1's time bounds every batch's
            layer = np.maximum(layer, kernels.layer_ms + kv / kv_bw)
        layer += 2 * self._allreduce_ms(config, batch * m.hidden_size * ACT_BYTES)
        return layer + self.profile.layer_overhead_us / 1e3

    def _kernels(self, config: ServiceConfig) -> DecodeKernels | None:
        """The measured decode kernels of an unsharded process of ``config``'s threads; for a
        thread count without records, the nearest measured count's times scaled by the thread
        ratio (so that plans of measured and unmeasured counts compare fairly)."""
        if config.tp != 1 or not self.decode_kernels:
            return None
        t = config.threads
        if t in self.decode_kernels:
            return self.decode_kernels[t]
        near = min(self.decode_kernels, key=lambda x: (abs(math.log(x / t)), x))
        k, f = self.decode_kernels[near], near / t
        return DecodeKernels(k.layer_ms * f, k.head_ms * f)

    def _decode_head_ms(self, config: ServiceConfig, resident: float | None = None, batch: int = 1) -> float:
        m, tp, b = self.model, config.tp, self.head_bytes
        bw = self.bandwidth_gbs(config, resident) * 1e6
        gemm = self.compute_gflops(config) * 1e6 * self.profile.gemm_efficiency
        weights = m.hidden_size * m.vocab_size / tp
        head = max(weights * b / bw, batch * 2 * weights / gemm)
        if (kernels := self._kernels(config)) is not None:
            head = max(head, kernels.head_ms)
        return head + float(self._allreduce_ms(config, batch * m.vocab_size * ACT_BYTES / tp))

    def ttft_ms(self, config: ServiceConfig, prompt: np.ndarray) -> np.ndarray:
        """Prefill time of prompts of the given lengths."""
        if config.wa:
            return self._separated_ms(config, prompt, decode=False)
        if config.pp > 1:
            return self._pipeline_ms(config, prompt, decode=False)
        s = np.asarray(prompt, dtype=float)
        layers = self.model.num_hidden_layers
        return layers * self._prefill_layer_ms(config, s) + self._prefill_head_ms(config)

    def tpot_ms(self, config: ServiceConfig, context: np.ndarray, batch: int = 1) -> np.ndarray:
        """Time of one decode step of ``batch`` sequences at the given context lengths (a
        separated model: batch 1 only)."""
        if config.wa:
            if batch != 1:
                raise ValueError("the separated model's decode is modelled at batch 1 only")
            return self._separated_ms(config, context, decode=True)
        if config.pp > 1:
            return self._pipeline_ms(config, context, decode=True, batch=batch)
        ctx = np.asarray(context, dtype=float)
        layers = self.model.num_hidden_layers
        return (layers * self._decode_layer_ms(config, ctx, batch=batch)
                + self._decode_head_ms(config, batch=batch))

    # ---- over the trace -------------------------------------------------------------
    def prefill_cost(self, config: ServiceConfig) -> float:
        """Mean TTFT over the trace (memoised per configuration)."""
        key = ("p", config.key, config.pp, config.wa)
        if key not in self._memo:
            self._memo[key] = self.ttft_ms(config, self.trace.prompt)
        return float(self._memo[key].mean())

    def decode_cost(self, config: ServiceConfig) -> float:
        """Mean decode time per request: output tokens x TPOT at the mid context."""
        return float((self.trace.output * self._tpot(config)).mean())

    def _tpot(self, config: ServiceConfig) -> np.ndarray:
        key = ("d", config.key, config.pp, config.wa)
        if key not in self._memo:
            mid = self.trace.prompt + self.trace.output / 2  # TPOT is linear in context
            self._memo[key] = self.tpot_ms(config, mid)
        return self._memo[key]

    def predict(self, prefill: ServiceConfig, decode: ServiceConfig) -> Prediction:
        tpot = self._tpot(decode)
        out = self.trace.output
        return Prediction(
            ttft_ms=self.prefill_cost(prefill),
            tpot_ms=float((out * tpot).sum() / out.sum()),
            decode_ms=self.decode_cost(decode),
        )


def _by_node(tree: TopoTree, depth: int) -> dict[int, int]:
    return {pu: i for i, node in enumerate(tree.nodes(depth)) for pu in node}


def _instances(tree: TopoTree, resource: Resource) -> dict[int, int]:
    """PU -> instance number of `resource` on the machine `tree` describes."""
    if resource.scope == "numa":
        return dict(zip(tree.pus, tree.domains, strict=True))
    if resource.scope == "latent":
        group = resource.size * resource.stride
        return {pu: (i // group) * resource.stride + i % resource.stride
                for i, pu in enumerate(sorted(tree.pus))}
    kind = {"package": "Package", "l3": "L3Cache", "core": "Core"}[resource.scope]
    depth = tree.depth_of(kind)
    return _by_node(tree, depth) if depth is not None else {pu: 0 for pu in tree.pus}


def measured_decode_kernels(cfg: LlamaConfig, dtype: str, threads: set[int],
                            records=None) -> dict[int, DecodeKernels]:
    """Per thread count, the decode GEMMs' m = 1 times from this host's tuning records (an
    unsharded model's shapes; a thread count missing any record is left out)."""
    from ..kernels.database import find_record
    from ..model.shapes import linear_shapes

    out = {}
    for t in sorted(threads):
        ms = {}
        for name, shape in linear_shapes(cfg, dtype).items():
            rec = find_record(shape, t, records)
            one = next((x for x in rec.tuned if x.m == 1 and math.isfinite(x.gflops) and x.gflops > 0),
                       None) if rec else None
            if one is None:
                break
            ms[name] = 2 * shape.n * shape.k / (one.gflops * 1e6)
        else:
            out[t] = DecodeKernels(sum(v for k, v in ms.items() if k != "lm_head"), ms["lm_head"])
    return out
