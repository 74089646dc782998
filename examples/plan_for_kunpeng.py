"""Rank Sandwich plans for Llama-3-8B on a modelled 4-socket Kunpeng 920 with the library API.

Run: .venv/bin/python examples/plan_for_kunpeng.py
"""

from sandwich_tvm.model.config import PRESETS
from sandwich_tvm.topology import load_tree, search_plans
from sandwich_tvm.topology.profile import load_profile
from sandwich_tvm.topology.trace import sample_sharegpt

KUNPENG_4S = ("package:4 l3:2(size=24MiB) [numa] l2:24(size=512KiB) l1d:1(size=64KiB) "
              "l1i:1(size=64KiB) core:1 pu:1")


def main() -> None:
    tree, _ = load_tree(synthetic=KUNPENG_4S)
    model = PRESETS["llama-3-8b"]
    trace = sample_sharegpt(64, max_context=model.max_position_embeddings)
    result = search_plans(tree, model, load_profile("kunpeng920-4s-192c"), trace, top_k=5)
    print(tree.render())
    for ranked in result.plans:
        plan, pred = ranked.plan, ranked.prediction
        print(f"TP={plan.tp}: prefill {plan.prefill.describe()}, decode {plan.decode.describe()}, "
              f"TTFT {pred.ttft_ms:.0f} ms, TPOT {pred.tpot_ms:.1f} ms  {' '.join(plan.transforms)}")


if __name__ == "__main__":
    main()
