"""The figures behind docs/attacks.md's membership validation: LiRA and RMIA (online with 16 reference models,
offline with 8) and LOSS on the overfit target of tests/test_membership.py (the `overfit` fixture: a perceptron
that memorised 1000 of 2000 candidates), and on its negative control (a model trained as long on other images).

    OMP_NUM_THREADS=1 python experiments/membership_validation.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_membership  # noqa: E402  (the fixture's data and models, one definition)

from eftguard.attacks.membership import MEMBERSHIP, MembershipObservation  # noqa: E402
from eftguard.audit import scoring  # noqa: E402


def main() -> None:
    build = getattr(test_membership.overfit, "__wrapped__", None) or test_membership.overfit._get_wrapped_function()
    target, control, fields, offline_references, is_member = build()
    offline = {**fields, "reference_trained_on": None, "references": offline_references}
    runs = [(f"{m} {v}", MEMBERSHIP.get(m)(variant=v), obs) for v, obs in (("online", fields), ("offline", offline))
            for m in ("lira", "rmia")] + [("loss", MEMBERSHIP.get("loss")(), fields)]
    print("| attack (references) | model | AUC | TPR at 0.1 % FPR | TPR at 1 % FPR |\n| --- | --- | --- | --- | --- |")
    for name, attack, obs in runs:
        for model_name, model in (("overfit target", target), ("negative control", control)):
            scores = attack.reconstruct(MembershipObservation("global", 1, model=model, **obs)).scores
            f = scoring.membership_figures(scores, is_member)
            count = f" ({len(obs['references'])})" if name != "loss" else ""
            print(f"| {name}{count} | {model_name} | {f['auc']:.3f} | {f['tpr_at_0.1pct_fpr']:.3f} | "
                  f"{f['tpr_at_1pct_fpr']:.3f} |")


if __name__ == "__main__":
    main()
