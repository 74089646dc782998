"""Host facts and the environment: thread counts, cache directories, option checks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from sandwich_tvm import host
from sandwich_tvm.host import HostError, ensure_writable, file_lock, half_precision_units, tvm_num_threads


@pytest.mark.parametrize("value,message", [("abc", "not a positive integer"), ("0", "not a positive integer"),
                                           ("64", "exceeds the")])
def test_bad_tvm_num_threads_is_refused(monkeypatch, value, message):
    if value == "64" and len(os.sched_getaffinity(0)) >= 64:
        pytest.skip("this machine has 64 CPUs")
    monkeypatch.setenv("TVM_NUM_THREADS", value)
    with pytest.raises(HostError, match=message):
        tvm_num_threads()


def test_bad_tvm_num_threads_gives_one_line_not_a_traceback():
    env = {**os.environ, "TVM_NUM_THREADS": "abc"}
    proc = subprocess.run([sys.executable, "-m", "sandwich_tvm.generate", "--prompt-len", "4"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "TVM_NUM_THREADS='abc'" in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_directory_is_reported_before_the_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(HostError, match="cannot write to the cache directory"):
        ensure_writable(blocker / "cache", "cache directory")
    assert ensure_writable(tmp_path / "new" / "dir").is_dir()


@pytest.mark.hwloc
def test_tune_plan_refuses_an_unwritable_out_before_exploring(tmp_path, capsys):
    from sandwich_tvm.cli import tune

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert tune.main(["plan", "--out", str(blocker / "out"), "--synthetic", "package:1 core:2 pu:1",
                      "--machine-profile", "generic", "--lengths", "64:16"]) == 2
    assert "cannot write to the --out directory" in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--max-m 0", "--max-m -4", "--window 0", "--threads -1", "--threads x",
                                    "--budget 0", "--budget x", "--search fast"])
def test_tune_kernels_refuses_nonsense_options(option, capsys):
    from sandwich_tvm.cli import tune

    with pytest.raises(SystemExit) as exit_:
        tune.main(["kernels", *option.split()])
    assert exit_.value.code == 2
    assert f"argument {option.split()[0]}" in capsys.readouterr().err


def test_tune_kernels_refuses_more_threads_than_cpus(capsys):
    from sandwich_tvm.cli import tune

    assert tune.main(["kernels", "--threads", str(len(os.sched_getaffinity(0)) + 1)]) == 2
    assert "exceeds the" in capsys.readouterr().out


def test_tune_kernels_refuses_more_threads_than_tvms_pool(monkeypatch, capsys):
    from sandwich_tvm.cli import tune

    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: --threads 2 is refused for the CPUs first")
    assert tune.main(["kernels", "--threads", "2"]) == 2
    assert "exceeds TVM's pool of 1" in capsys.readouterr().out


def test_tune_kernels_refuses_an_unwritable_records_directory_before_measuring(tmp_path, capsys):
    from sandwich_tvm.cli import tune

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert tune.main(["kernels", "--model", "llama-34m", "--records", str(blocker / "records")]) == 2
    out = capsys.readouterr().out
    assert "cannot write to the records directory" in out and not (tmp_path / "measured").exists()


def test_torch_baseline_dtype_follows_the_cpu():
    from sandwich_tvm.bench.e2e import torch_dtype

    dtype, why = torch_dtype("auto")
    assert dtype == ("bfloat16" if half_precision_units() else "float32") and why
    assert torch_dtype("float32")[0] == "float32"
    assert half_precision_units({"avx2", "avx512_bf16"}) == ["avx512_bf16"]
    assert half_precision_units({"avx2", "fma"}) == []
    assert half_precision_units({"asimd", "bf16"}) == ["bf16"]  # Arm: torch's bf16 kernels too


def _hold_lock(lock, ready, log) -> None:
    with file_lock(lock):
        ready.set()
        time.sleep(0.3)
        with open(log, "a") as fh:
            fh.write("first\n")


def test_file_lock_makes_processes_take_turns(tmp_path):
    """The ranks of a new group build the all-reduce under this lock: the second waits."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(tmp_path / ".lock", ready, tmp_path / "log"))
    holder.start()
    assert ready.wait(60)
    with file_lock(tmp_path / ".lock"), open(tmp_path / "log", "a") as fh:
        fh.write("second\n")
    holder.join(60)
    assert (tmp_path / "log").read_text().splitlines() == ["first", "second"]


ZEN5_FLAGS = "fpu sse4_2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
XEON_FLAGS = ZEN5_FLAGS + " avx_vnni avx512_fp16 amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize("cap,isa,kept,dropped", [
    ("avx2", "avx2", {"avx2", "fma", "avx_vnni"}, {"avx512f", "avx512_bf16", "amx_tile"}),
    ("avx512", "avx512", {"avx512f", "avx512bw"}, {"avx512_bf16", "avx512_fp16", "amx_bf16"}),
    ("avx512bf16", "avx512", {"avx512_bf16", "avx512_fp16"}, {"amx_tile", "amx_bf16"}),
    ("amx", "avx512", {"amx_tile", "avx512_bf16"}, set()),
])
def test_max_isa_caps_what_every_layer_sees(monkeypatch, cap, isa, kept, dropped):
    monkeypatch.setattr(host, "_own_cpuinfo", lambda: {"vendor_id": "GenuineIntel", "flags": XEON_FLAGS})
    monkeypatch.setattr(host, "arm_hwcaps", lambda: None)  # (an Arm host reads its hwcaps first)
    monkeypatch.setenv("SANDWICH_MAX_ISA", cap.upper())
    flags = host.cpu_flags()
    assert kept <= flags and not dropped & flags
    assert host.isa_of(flags) == isa
    mattr = host.llvm_mattr()
    assert all(f"+{host.LLVM_FEATURES[f]}" in mattr for f in kept)
    assert all(f"+{host.LLVM_FEATURES[f]}" not in mattr for f in dropped)
    if cap == "avx2":
        assert "-avx512f" in mattr and host.half_precision_units() == []


def test_max_isa_gives_a_distinct_signature_and_rejects_unknown_caps(monkeypatch):
    code = "from sandwich_tvm.host import host_signature as s; print(s().isa, s().slug)"
    out = {}
    for cap in ("", "avx2"):
        env = {**os.environ, "SANDWICH_MAX_ISA": cap}
        out[cap] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                  text=True, timeout=60, check=True).stdout.split()
    assert out["avx2"][0] == "avx2" or out[""][0] not in ("avx512", "avx2")
    if out[""][0] == "avx512":
        assert out["avx2"][1] != out[""][1]  # records tuned under the cap live apart
    monkeypatch.setenv("SANDWICH_MAX_ISA", "avx1024")
    with pytest.raises(HostError, match="not a known cap.*avx2"):
        host.cpu_flags()


ARM_CPU = {"machine": "aarch64",
           "flags": ["fp", "asimd", "asimddp", "asimdhp", "bf16", "i8mm", "sve", "sve2"],
           "cpuinfo": {"CPU implementer": "0x41", "CPU part": "0xd4f", "model name": "Neoverse V2"},
           "caches_kib": [64, 2048, 117760]}


def test_a_described_cpu_is_what_code_is_built_for_and_this_one_what_runs(monkeypatch, tmp_path):
    """SANDWICH_CPU (cross-compiling): the ISA, flags, LLVM target and signature are the
    described CPU's; can_run still answers for this process, which cannot run Arm code."""
    import platform

    from sandwich_tvm.tvm_compat import host_target, linker_for

    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(ARM_CPU))
    own = host.host_signature()
    monkeypatch.setenv("SANDWICH_CPU", str(path))
    assert host.machine() == "aarch64" and host.host_isa() == "neon"
    assert {"asimddp", "bf16"} <= host.cpu_flags()
    sig = host.host_signature()
    assert sig.isa == "neon" and sig.l3_kib == 117760 and sig.slug != own.slug  # its own records
    mattr = host.llvm_mattr()
    assert "+dotprod" in mattr and "+bf16" in mattr and "+sve" not in mattr  # NEON kernels only
    target = host_target(2)
    assert str(target.attrs["mtriple"]) == "aarch64-linux-gnu"
    if platform.machine() != "aarch64":
        assert not host.can_run("neon") and host.can_run(host.isa_of(host.own_cpu_flags()))  # it runs its own
        monkeypatch.setattr("sandwich_tvm.tvm_compat.cross_linker", lambda triple: None)
        with pytest.raises(HostError, match="pip install ziglang"):
            linker_for(target)


def test_a_description_of_this_cpu_gives_its_own_signature(monkeypatch, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sandwich_tvm.host", "--describe"], capture_output=True,
                          text=True, timeout=60, check=True)
    (tmp_path / "me.json").write_text(proc.stdout)
    own = host.host_signature()
    monkeypatch.setenv("SANDWICH_CPU", str(tmp_path / "me.json"))
    assert host.host_signature() == own


ONE_CACHE = '{"machine": "x86_64", "flags": [], "cpuinfo": {}, "caches_kib": [1]}'


@pytest.mark.parametrize("text,message", [("{", "not a CPU description"),
                                          ('{"machine": "x86_64"}', "lacks flags, cpuinfo, caches_kib"),
                                          (ONE_CACHE, "three cache sizes")])
def test_a_bad_cpu_description_is_refused_with_what_to_do(monkeypatch, tmp_path, text, message):
    (tmp_path / "bad.json").write_text(text)
    monkeypatch.setenv("SANDWICH_CPU", str(tmp_path / "bad.json"))
    with pytest.raises(HostError, match=message) as err:
        host.cpu_flags()
    assert "--describe" in str(err.value)
    monkeypatch.setenv("SANDWICH_CPU", str(tmp_path / "missing.json"))
    with pytest.raises(HostError, match="not a CPU description"):
        host.host_isa()


ZEN3_CPU = {"machine": "x86_64", "flags": ["fpu", "sse4_2", "avx", "avx2", "fma", "f16c"],
            "cpuinfo": {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "1",
                        "model name": "AMD EPYC"},
            "caches_kib": [32, 512, 32768]}


def test_a_described_cpu_of_this_architecture_gets_a_generic_name_and_only_its_flags(monkeypatch, tmp_path):
    """Not this machine's LLVM CPU name, which would add the features this CPU has beyond it."""
    from sandwich_tvm.tvm_compat import host_target, isa_target, local_target

    (tmp_path / "zen3.json").write_text(json.dumps(ZEN3_CPU))
    own = local_target(2)
    monkeypatch.setenv("SANDWICH_CPU", str(tmp_path / "zen3.json"))
    target = host_target(2)
    assert str(target.attrs["mcpu"]) == "x86-64-v3" and str(target.attrs["mtriple"]) == "x86_64-linux-gnu"
    mattr = [str(a) for a in target.attrs["mattr"]]
    assert "+avx2" in mattr and "-avx512f" in mattr and "+avx512vnni" not in mattr
    assert str(isa_target("avxvnni").attrs["mcpu"]) == "x86-64-v3"  # a unit it lacks: the generic target
    assert str(local_target(2)) == str(own)  # what this process runs is still built for itself


def test_what_runs_code_here_refuses_to_start_under_a_described_cpu(monkeypatch, tmp_path):
    (tmp_path / "arm.json").write_text(json.dumps(ARM_CPU))
    env = {**os.environ, "SANDWICH_CPU": str(tmp_path / "arm.json")}
    for argv in (["-m", "sandwich_tvm.generate", "--prompt-len", "4"],
                 ["-m", "sandwich_tvm.bench", "gemm", "--n", "8", "--k", "32"]):
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert "SANDWICH_CPU is set (building for Neoverse V2)" in proc.stderr + proc.stdout
    monkeypatch.setenv("SANDWICH_CPU", str(tmp_path / "arm.json"))
    with pytest.raises(HostError, match="unset SANDWICH_CPU to run here"):
        host.require_own_cpu("tuning")


def test_the_cache_set_by_the_environment_needs_no_home_directory(monkeypatch, tmp_path):
    """``SANDWICH_CACHE`` alone names the cache (every kernel parse reads it): a container with
    no home directory does not fail."""
    from pathlib import Path

    from sandwich_tvm.host import cache_dir

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setenv("SANDWICH_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SANDWICH_CACHE")
    with pytest.raises(RuntimeError, match="home"):
        cache_dir()
