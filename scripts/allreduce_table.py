"""Print the markdown table the README quotes from a `bench allreduce --json` result.

    python -m sandwich_tvm.bench allreduce --json > out/allreduce.json
    python scripts/allreduce_table.py out/allreduce.json
"""

from __future__ import annotations

import json
import sys


def size(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def table(result: dict) -> str:
    out = [f"(streaming read on CPUs {result['cpus']} in the same run: {result['read_gbs']:.1f} GB/s)", "",
           "| processes | message | shm µs | gloo µs | shm / gloo | shm bus GB/s | shm memory GB/s "
           "| of read bandwidth |",
           "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['procs']} | {size(r['bytes'])} | {r['shm_us']:.1f} | {r['gloo_us']:.0f} | "
                   f"{r['latency_ratio']:.4f} | {r['shm_bus_gbs']:.2f} | {r['shm_mem_gbs']:.1f} | "
                   f"{r['shm_mem_of_read']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as fh:
            print(table(json.load(fh)))
