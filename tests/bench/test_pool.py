"""`bench pool`: the thread pool's cost per call of a tiny parallel kernel on 1..N threads, and
a model's decode launches counted from its compiled library."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.bench.cli import main
from sandwich_tvm.tvm_compat import PROCESS_CPUS


def test_pool_times_every_thread_count_and_the_barrier(tmp_path):
    out = tmp_path / "pool.json"
    assert main(["pool", "--number", "200", "--repeat", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    n = len(PROCESS_CPUS)
    assert list(doc["parallel_us"]) == [str(t) for t in range(1, n + 1)] and doc["serial_us"] > 0
    assert all(us > 0 for us in doc["parallel_us"].values())
    assert doc["barrier_us"] == pytest.approx(doc["parallel_us"][str(n)] - doc["serial_us"])
    assert doc["command"].startswith("python -m sandwich_tvm.bench pool --number 200")


@pytest.mark.compile
def test_pool_counts_a_models_decode_launches_and_its_share(tmp_path):
    pytest.importorskip("torch")
    from ..model.hf_models import write_hf_model

    write_hf_model("gqa-small", tmp_path / "gqa-small")  # 2 layers; named as the prefix-cache bench's
    out = tmp_path / "pool.json"
    assert main(["pool", "--number", "200", "--repeat", "2", "--model", str(tmp_path / "gqa-small"),
                 "--dtype", "float32", "--steps", "8", "--json", str(out)]) == 0
    m = json.loads(out.read_text())["model"]
    # per layer: two norms, the QKV, O, gate_up and down GEMMs, and one cache attention call
    assert m["cache_attention_calls"] == 2 and m["kernel_calls"] >= 2 * 6
    assert m["launches"] == m["kernel_calls"] + 4 * m["cache_attention_calls"]
    # the share is the launches' barrier time over the step, whatever the timings (a busy machine
    # can make the barrier probe exceed a whole step, so no bound is asserted on it)
    doc = json.loads(out.read_text())
    assert m["tpot_ms"] > 0
    assert m["barrier_ms_per_step"] == pytest.approx(m["launches"] * doc["barrier_us"] / 1e3)
    assert m["barrier_share"] == pytest.approx(m["barrier_ms_per_step"] / m["tpot_ms"])
