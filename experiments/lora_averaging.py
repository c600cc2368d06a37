"""How far FedAvg of LoRA factors is from FedAvg of the clients' weight updates, per round of a fed-lora run:
|| avg(B) avg(A) - avg(B A) || per layer (eftguard.peft.lora_averaging_gap), weighted by n_k as the server
weights them, relative to the whole LoRA product avg(B A) and to the round's averaged update
avg(B A) - B_start A_start. Usage: python experiments/lora_averaging.py RUN_DIR"""

import sys

import numpy as np

from eftguard.peft import lora_averaging_gap
from eftguard.rundir import RunDirectory


def main(path: str) -> None:
    run = RunDirectory.open(path)
    for record in run.metrics():
        round_number, examples = record["round"], record["num_examples"]
        uploads = [run.load_upload(round_number, int(k), "update") for k in examples]
        start = {k: v.numpy() for k, v in run.load_checkpoint(round_number - 1).items()}
        weights = list(examples.values())
        of_product = np.array(list(lora_averaging_gap(uploads, weights).values()))
        of_update = np.array(list(lora_averaging_gap(uploads, weights, start).values()))
        print(f"round {round_number}: {len(uploads)} clients, {len(of_product)} layers; gap relative to avg(BA): "
              f"median {np.median(of_product):.4f}, max {of_product.max():.4f}; relative to the round's update: "
              f"median {np.median(of_update):.4f}, max {of_update.max():.4f}; test accuracy "
              f"{record['test_accuracy']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
