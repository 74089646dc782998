"""`bench cache-resident` on the modelled cluster of the cache-resident paper (dual-socket EPYC
9684X servers, 1,152 MB of L3 a socket; profile values modelled): the planner picks pipelines
whose every stage keeps its weights in its socket's LLC, for Llama-3.2-3B and Llama-2-7B in
int8, and their predicted TPOT speedup over one socket (micro-batches in flight through the
pipeline) falls as the batch grows to 32."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.bench.cli import main

pytestmark = pytest.mark.hwloc


def test_planner_picks_cache_resident_pipelines_whose_edge_falls_with_batch(capsys):
    assert main(["cache-resident", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["modelled"] and doc["sockets"] == 16 and doc["profile"] == "epyc-9684x-2s"
    # the shallowest even splits whose every stage fits 0.75 of 1,152 MiB (the head on the first)
    assert [(m["model"], m["pp"]) for m in doc["models"]] == [("llama-3.2-3b", 6), ("llama-2-7b", 9)]
    for model in doc["models"]:
        assert model["cache_resident"] and model["stages_resident"] == model["pp"]
        assert max(model["stage_weights_mb"]) <= 0.75 * model["llc_mb_per_socket"]
        assert model["weights_gb"] > 0.75 * model["llc_mb_per_socket"] / 1e3  # one socket cannot hold it
        single = next(r for r in model["ranking_batch1"] if r["pp"] == 1)
        assert not single["resident"] and single["tpot_ms"] > 5 * model["rows"][0]["tpot_ms"]
        speedup = [r["speedup"] for r in model["rows"]]
        assert [r["batch"] for r in model["rows"]] == [1, 2, 4, 8, 16, 32]
        assert speedup[0] > 5 and speedup[-1] < speedup[0] / 2
        assert all(b < a for a, b in zip(speedup, speedup[1:], strict=False))  # falling as the batch grows
        assert all(s > 1 for s in speedup)


def test_a_pipeline_of_sockets_without_an_llc_roof_gains_nothing_from_depth(tmp_path, capsys):
    from sandwich_tvm.topology.profile import load_profile

    raw = json.loads(load_profile("epyc-9684x-2s").to_json())
    raw.update(name="no-llc", llc_gbs_per_core=0.0)
    (tmp_path / "no-llc.json").write_text(json.dumps(raw))
    assert main(["cache-resident", "--models", "llama-3.2-3b", "--profile", str(tmp_path / "no-llc.json"),
                 "--batches", "1", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["models"][0]
    assert model["pp"] == 1 and model["rows"][0]["speedup"] == pytest.approx(1.0)


def test_a_topology_hwloc_rejects_is_a_clear_error(capsys):
    assert main(["cache-resident", "--synthetic", "package:2 nonsense:3", "--json"]) == 2
    assert "hwloc rejected the synthetic description" in capsys.readouterr().err


def test_the_papers_models_have_their_sizes():
    from sandwich_tvm.model.config import PRESETS

    assert PRESETS["llama-3.2-3b"].num_params() == pytest.approx(3.21e9, rel=0.01)
    assert PRESETS["llama-2-7b"].num_params() == pytest.approx(6.74e9, rel=0.01)
