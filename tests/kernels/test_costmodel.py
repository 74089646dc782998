"""The learned cost model, the model-guided search and transfer, on synthetic timings (no TVM)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from sandwich_tvm.host import host_signature
from sandwich_tvm.kernels.costmodel import (
    FEATURES,
    CostModel,
    Sample,
    features,
    grouped_check,
    spearman,
    training_samples,
)
from sandwich_tvm.kernels.database import KernelRecord, read_record, save_record
from sandwich_tvm.kernels.guided import best_first, fitting, nearest_tuned
from sandwich_tvm.kernels.measurements import MeasurementLog, all_measurements, read_measurements
from sandwich_tvm.kernels.microkernel import MicroKernel, microkernels
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.kernels.search import Problem, Tuned, caps, diverse, neighbours, ranked, run_search, space
from sandwich_tvm.kernels.transfer import guess, shape_distance, transfer_sources

CPU = replace(host_signature(), isa="avx512", features=("avx512f",), l1d_kib=32, l2_kib=1024, l3_kib=32768)
MKS = microkernels("avx512", "float32")


def synthetic_gflops(p: Problem, s: GemmSchedule) -> float:
    """A made-up but structured speed: full rows and tiles, a KC near 256, an NC block in L2."""
    rows = p.m / (math.ceil(p.m / s.mk.mr) * s.mk.mr)
    vec = s.mk.nr // s.mk.lanes
    tile = s.mk.mr * vec / (s.mk.mr * vec + vec + s.mk.mr)
    kc = math.exp(-abs(math.log2(s.slice.kc / 256)) / 2)
    nc = math.exp(-abs(math.log2(s.slice.nc * s.slice.kc * 4 / (512 << 10))) / 3)
    split = 0.9 if s.poly.pk > 1 else 1.0
    return 100.0 * rows * tile * kc * nc * split


def _samples(shapes, ms, per_task=30, seed=0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for shape in shapes:
        for m in ms:
            p = Problem(m, shape.n, shape.k, 2)
            for s in rng.sample(space(p, MKS), per_task):
                out.append(Sample(CPU, 2, shape, m, s, synthetic_gflops(p, s)))
    return out


def test_features_are_one_row_of_named_values():
    s = GemmSchedule(MicroKernel("avx512", 4, 64), Slice(8, 128, 256), Polymerization(1, 2, 1))
    row = features(CPU, 2, GemmShape(2048, 2048, "float32", "residual"), 16, s)
    assert len(row) == len(FEATURES) and all(math.isfinite(v) for v in row)
    named = dict(zip(FEATURES, row, strict=True))
    assert named["mr"] == 4 and named["vectors"] == 4 and named["epi_residual"] == 1.0
    assert named["log_m"] == 4 and named["pn"] == 2 and named["weight_bytes"] == 4.0
    q8 = dict(zip(FEATURES, features(CPU, 2, GemmShape(2048, 2048, "q8_0"), 1, replace(
        s, mk=MicroKernel("avx512", 4, 64, "q8_0"))), strict=True))
    assert q8["weight_bytes"] == pytest.approx(34 / 32)


def test_spearman_matches_the_definition():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505139)  # scipy's value
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_cost_model_ranks_schedules_of_a_shape_it_never_saw(tmp_path):
    train = _samples([GemmShape(576, 576), GemmShape(960, 576), GemmShape(1536, 768)], [1, 4, 16, 64])
    model = CostModel.train(train)
    unseen = GemmShape(2048, 2048)
    p = Problem(16, unseen.n, unseen.k, 2)
    cands = random.Random(1).sample(space(p, MKS), 60)
    truth = [synthetic_gflops(p, s) for s in cands]
    assert spearman(model.predict(CPU, 2, unseen, 16, cands), truth) > 0.6
    # saved and loaded: the same predictions
    path = model.save(tmp_path / "costmodel.json")
    again = CostModel.load(path).predict(CPU, 2, unseen, 16, cands)
    np.testing.assert_allclose(again, model.predict(CPU, 2, unseen, 16, cands), rtol=1e-6)
    assert grouped_check(train, folds=3) and np.median(grouped_check(train, folds=3)) > 0.5


def test_a_damaged_cost_model_file_says_how_to_rebuild_it(tmp_path):
    bad = tmp_path / "costmodel.json"
    bad.write_text("{not a model")
    with pytest.raises(ValueError, match="tune costmodel"):
        CostModel.load(bad)
    with pytest.raises(ValueError, match="too few"):
        CostModel.train(_samples([GemmShape(64, 64)], [1], per_task=3))


def test_ranked_search_measures_only_the_top_few_and_finds_a_good_schedule():
    train = _samples([GemmShape(576, 576), GemmShape(960, 576), GemmShape(1536, 768)], [1, 4, 16, 64])
    model = CostModel.train(train)
    shape = GemmShape(2048, 2048)
    p = Problem(64, shape.n, shape.k, 2)
    measured: list[GemmSchedule] = []

    def measure(batch):
        measured.extend(batch)
        return [synthetic_gflops(p, s) for s in batch]

    best, g = run_search(ranked(p, fitting(MKS, 64), lambda q, schs: model.predict(CPU, 2, shape, q.m, schs)),
                         measure)
    everything = max(synthetic_gflops(p, s) for s in space(p, MKS))
    assert len(measured) <= 4 + 2 * 2 and best in measured
    assert g >= 0.85 * everything  # a handful of measurements, close to the whole space's best


def test_ranked_search_measures_the_guesses_first_and_keeps_a_confirmed_one():
    p = Problem(8, 512, 512, 2)
    good = GemmSchedule(MicroKernel("avx512", 8, 32), Slice(8, 64, 256), Polymerization(1, 2, 1))
    first = []

    def measure(batch):
        first.append(batch)
        return [1000.0 if s == good else 1.0 for s in batch]

    best, g = run_search(ranked(p, MKS, lambda q, schs: [0.0] * len(schs), guesses=[good]), measure)
    assert first[0][0] == good and best == good and g == 1000.0


def test_the_first_batch_spans_micro_kernels():
    """A model that rates one register tile above all others measures its best schedule and the
    best of the next micro-kernels, not four tilings of the same one."""
    p = Problem(64, 2048, 2048, 2)
    cands = space(p, fitting(MKS, 64))
    favourite = cands[0].mk
    pred = [10.0 + (s.slice.nc / 1e4) if s.mk == favourite else s.mk.nr / 1e3 for s in cands]
    picked = diverse(cands, pred, 4)
    assert len(picked) == 4 and len({s.mk for s in picked}) == 4 and picked[0].mk == favourite
    assert picked[0] == max((s for s in cands if s.mk == favourite), key=lambda s: s.slice.nc)
    one = [s for s in cands if s.mk == favourite][:6]
    assert diverse(one, list(range(6)), 4) == one[::-1][:4]  # one micro-kernel only: the best four


def test_space_and_neighbours_stay_within_the_caps():
    p = Problem(5, 96, 64, 2)
    for s in space(p, MKS[:6]):
        cap = caps(p, s.mk, s.poly)
        assert s.slice.mc <= cap.mc and s.slice.nc <= cap.nc and s.slice.kc <= cap.kc
        assert s.slice.mc % s.mk.mr == 0 and s.slice.nc % s.mk.nr == 0
    s = space(p, MKS[:1])[0]
    near = neighbours(p, s)
    assert s not in near and {x.poly for x in near} == {q for q in (Polymerization(1, 2, 1),
                                                                   Polymerization(2, 1, 1),
                                                                   Polymerization(1, 1, 2))}


def test_best_first_starts_with_decode_then_covers_the_range_coarse_to_fine():
    ladder = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]
    order = best_first(ladder)
    assert sorted(order) == ladder and order[:3] == [1, 64, 6]
    assert best_first([]) == [] and best_first([1]) == [1]
    done = [Tuned(1, None, 1.0, True), Tuned(64, None, 1.0, True), Tuned(8, None, math.nan, False)]
    assert nearest_tuned(done, 6).m == 1 and nearest_tuned(done, 10).m == 64  # nearest in log m
    assert nearest_tuned(done[2:], 8) is None  # an unsearched point is no evidence


def test_fitting_drops_tiles_taller_than_m():
    assert all(mk.mr <= 3 for mk in fitting(MKS, 3))
    assert fitting(MKS, 0) == [min(MKS, key=lambda mk: mk.mr)]


def test_measurement_log_appends_and_skips_a_torn_line(tmp_path):
    shape = GemmShape(96, 64)
    log = MeasurementLog(shape, 2, CPU, tmp_path)
    s = space(Problem(2, 96, 64, 2), MKS[:1])[:3]
    log.record(2, s, [1.0, 2.0, 3.0])
    log.record(4, s[:1], [5.0])
    with open(log.path, "a") as fh:
        fh.write('{"m": 8, "s": {"mk"')  # a write cut short by a crash
    rows = list(read_measurements(log.path))
    assert [(r.m, r.gflops) for r in rows] == [(2, 1.0), (2, 2.0), (2, 3.0), (4, 5.0)]
    assert rows[0].schedule == s[0] and rows[0].shape == shape and rows[0].cpu == CPU
    assert len(all_measurements(tmp_path)) == 4
    (tmp_path / "x" / "t2" / "measured").mkdir(parents=True)
    (tmp_path / "x" / "t2" / "measured" / "linear_bad.jsonl").write_text("garbage\n")
    assert len(all_measurements(tmp_path)) == 4  # a file without a header yields nothing


def _rec(shape: GemmShape, cpu=CPU, m=(1, 16)) -> KernelRecord:
    mk = MicroKernel(cpu.isa, 4, 64) if cpu.isa == "avx512" else MicroKernel(cpu.isa, 4, 16)
    sch = GemmSchedule(mk, Slice(4, 128, 256), Polymerization(1, 2, 1))
    return KernelRecord(shape, 2, cpu, [Tuned(x, sch, 50.0, True) for x in m])


def test_transfer_prefers_this_cpu_and_the_nearest_shape(tmp_path):
    here = CPU
    save_record(_rec(GemmShape(1024, 1024)), tmp_path)
    save_record(_rec(GemmShape(4096, 4096)), tmp_path)
    other = replace(CPU, model=CPU.model + 1 if CPU.model else 99)  # same ISA family, another CPU
    save_record(_rec(GemmShape(2048, 2048), cpu=other), tmp_path)
    avx2 = replace(CPU, isa="avx2", model=(CPU.model or 0) + 2)
    save_record(_rec(GemmShape(2048, 2048), cpu=avx2), tmp_path)
    got = transfer_sources(GemmShape(2048, 1024), 2, here, [tmp_path], limit=3)
    labels = [label for _, label in got]
    assert labels[0].endswith("linear_n1024_k1024_float32.json") and here.slug in labels[0]
    assert other.slug in labels[2] and not any(avx2.slug in x for x in labels)
    assert shape_distance(GemmShape(2048, 1024), GemmShape(1024, 1024)) == 1.0
    # a guess is the source's schedule for m when this shape and CPU can run it
    rec = got[0][0]
    assert guess(rec, GemmShape(2048, 1024), 16, 2, "avx512") == rec.schedule_for(16)
    assert guess(rec, GemmShape(2048, 1024), 16, 4, "avx512") is None  # other thread count


def test_records_carry_how_they_were_searched_and_what_seeded_them(tmp_path):
    rec = _rec(GemmShape(256, 256))
    rec.search, rec.transferred_from = "model", ["cpu-x/linear_n128_k256_float32.json"]
    back = read_record(save_record(rec, tmp_path))
    assert back.search == "model" and back.transferred_from == rec.transferred_from
    d = json.loads(save_record(_rec(GemmShape(128, 128)), tmp_path).read_text())
    del d["search"], d["transferred_from"]  # a record written before them reads as a full search
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert read_record(tmp_path / "old.json").search == "full"


def test_training_samples_leave_out_the_held_out_shapes(tmp_path):
    save_record(_rec(GemmShape(256, 256)), tmp_path)
    save_record(_rec(GemmShape(512, 256)), tmp_path)
    one = _rec(GemmShape(512, 256)).tuned[0].schedule
    MeasurementLog(GemmShape(512, 256), 2, CPU, tmp_path).record(1, [one], [7.0])
    all_ = training_samples(tmp_path, shipped=False)
    assert len(all_) == 5  # 2 x 2 winners and one measurement
    held_out = training_samples(tmp_path, exclude=[(512, 256)], shipped=False)
    assert {(s.shape.n, s.shape.k) for s in held_out} == {(256, 256)}
    assert len(training_samples(tmp_path)) > len(all_)  # the shipped records and measurements too
