"""Size planning (eftguard plan): the bytes a run directory will hold, per round and in all, before anything is
trained: from the model's parameter shapes, the method's upload shapes, each client's feature rows (the run's data
plan: the dataset's labels, partition and median sampling) and the run's retention (docs/run-directory.md#size)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition, run_dataset
from eftguard.masking import kept_token_count
from eftguard.methods import method_spec
from eftguard.model import EFTViT, build_model
from eftguard.options import at_least, option
from eftguard.precision import computing_in
from eftguard.retention import Retention
from eftguard.sampling import balanced_indices
from eftguard.training import saved_activation_bytes

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


@dataclass
class PlanOptions:
    images_per_client: int = option(0, "images (feature rows) every client uploads per round, for data not on this "
                                       "machine (e.g. 500 for CIFAR-100 over 100 clients); 0: each client's own rows "
                                       "from the run's data plan (the dataset is read, nothing is trained)",
                                    bound=at_least(0))
    server_memory_gb: float = option(0.0, "memory the server may use for a round's feature rows and theta's training, "
                                          "in GB (1e9 bytes); 0: this machine's physical memory", bound=at_least(0))


def safetensors_bytes(shapes: Shapes) -> int:
    """The size of a safetensors file of these tensors: 8 bytes, its JSON header padded to 8, the data."""
    header, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = len(json.dumps(header, separators=(",", ":")))
    return 8 + text + (-text) % 8 + offset


def shapes_of(state: dict[str, torch.Tensor], floats: torch.dtype) -> Shapes:
    return {k: (tuple(v.shape), floats if v.is_floating_point() else v.dtype) for k, v in state.items()}


def client_rows(cfg: TrainConfig, num_classes: int, images_per_client: int) -> list[int]:
    """The rows of each client's upload and truth per round: its median-sampled feature sets, whose count does not
    depend on the draw (T per class it holds), or for a method without features its images; images_per_client for
    every client when given."""
    if images_per_client:
        return [images_per_client] * cfg.clients
    partitions = client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients,
                                  cfg.beta)
    if not method_spec(cfg.method).uploads_features:
        return [len(ids) for ids in partitions]
    labels = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).train.labels
    return [len(balanced_indices(labels[ids], num_classes, cfg.balance, np.random.default_rng(0)))
            for ids in partitions]


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def server_memory(cfg: TrainConfig, model: EFTViT, round_rows: int, client_rows: int, tokens: int, width: int,
                  memory: int) -> dict | None:
    """What the server holds while it trains theta on round_rows feature rows (None: the method trains no theta).
    --server-rows memory: eftguard.federation.server.run_round holds every row of the round twice while theta
    trains, the decoded uploads and the concatenation theta trains on (each reply is released once parsed).
    --server-rows disk (eftguard.federation.rows): the rows go to a spool under RUN/tmp/ as each reply is parsed and
    theta reads its batches from a memory-mapped file, so the server holds one client's rows at a time, twice
    (its reply and their decoding; replies that arrive within one poll are held together), and the round's rows
    take their bytes on disk instead. Theta's training adds the whole model, the global module's gradients and
    AdamW's two moments, and a batch's activations (measured: the tensors autograd saves for one row, times the
    batch size)."""
    if not method_spec(cfg.method).server_trains or not cfg.server_epochs:
        return None
    row = tokens * width * 4 + 8  # float32 tokens and an int64 label
    on_disk = cfg.server_rows == "disk"
    theta = sum(p.numel() for p in model.global_module.parameters()) * 4
    model.train()
    model.head.requires_grad_(False)  # as train_global trains theta

    def one_row() -> None:
        with computing_in(model, cfg.precision):
            model.classify(torch.zeros(1, tokens, width))

    activations = saved_activation_bytes(model, one_row) * cfg.batch_size
    model.head.requires_grad_(True)
    whole_model = sum(p.numel() for p in model.parameters()) * 4
    training = whole_model + 3 * theta + activations
    store = 2 * (client_rows if on_disk else round_rows) * row
    fits = store + training <= memory
    return {"server_rows": cfg.server_rows, "rows_in_largest_round": round_rows, "bytes_per_row": row,
            "rows_held": client_rows if on_disk else round_rows, "copies": 2, "feature_store": store,
            "spool_on_disk": round_rows * row if on_disk else 0,
            "theta_training": {"model": whole_model, "gradients_and_adamw": 3 * theta,
                               "activations_per_batch": activations, "total": training},
            "total": store + training, "memory": memory, "fits": fits,
            "rows_that_fit": None if on_disk else max(0, (memory - training) // (2 * row)),
            "streams_from_disk": on_disk}


def plan_run(cfg: TrainConfig, images_per_client: int = 0, server_memory_gb: float = 0.0) -> dict:
    """Bytes per round (checkpoint; update, features, heads and truth per client) and the projected run
    directory: checkpoints, uploads and truth the retention keeps, and what simulated nodes hold while it trains; and
the server's memory in its largest round (server_memory)."""
    from eftguard.federation.client import select_clients  # Flower (0.4 s): only this command needs it

    method = method_spec(cfg.method)
    num_classes = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples,
                              cfg.seed).num_classes
    model = build_model(cfg.model, num_classes, cfg.local_layers, seed=cfg.seed, adapt=method.model_adapter(cfg))
    store = getattr(torch, cfg.store_uploads)
    checkpoint = safetensors_bytes(shapes_of(model.state_dict(), torch.float32))
    update = safetensors_bytes(shapes_of(method.heads.kept_update(method.uploaded_state(model), model), store))
    _, heads = method.heads.upload_layout(model, cfg.head_sparsity)
    head_record = safetensors_bytes({"importance": ((heads[0], heads[1]), store),
                                     "kept": ((heads[0], heads[2]), torch.int64)}) if heads else 0
    tokens = 1 + kept_token_count(model.local_module.num_patches, method.mask_ratio(cfg.mask_ratio))
    width = model.local_module.token_embedding.pos_embed.shape[-1]
    rows = client_rows(cfg, num_classes, images_per_client)
    per_client = []
    for n in rows:
        features = safetensors_bytes({"features": ((n, tokens, width), store), "labels": ((n,), torch.int64)}) \
            if method.uploads_features else 0
        truth = safetensors_bytes({"sample_ids": ((n,), torch.int64), "class_counts": ((num_classes,), torch.int64),
                                   **({"kept_ids": ((n, tokens - 1), torch.int64)} if method.uploads_features
                                      else {})}) if cfg.record_truth else 0
        per_client.append({"update": 0 if cfg.secagg else update, "features": features, "heads": head_record,
                           "truth": truth})
    aggregate = update if cfg.secagg else 0  # --secagg: the round's one update, the cohort's sum, stored alike
    retention = Retention.of(cfg)
    uploads = {r: [k for k in select_clients(cfg, r) if retention.keeps_upload(r, k)] for r in retention.rounds_kept}
    kept_upload_bytes = sum(sum(per_client[k].values()) for clients in uploads.values() for k in clients) + \
        aggregate * len(retention.rounds_kept)
    every_upload = sum(sum(per_client[k].values()) for r in range(1, cfg.rounds + 1) for k in select_clients(cfg, r)) \
        + aggregate * cfg.rounds
    checkpoints = len(retention.checkpoints_kept) * checkpoint
    largest_round = max(sum(rows[k] for k in select_clients(cfg, r)) for r in range(1, cfg.rounds + 1))
    mean = {part: round(float(np.mean([c[part] for c in per_client]))) for part in per_client[0]}
    return {
        "config": {"model": cfg.model, "method": cfg.method, "clients": cfg.clients,
                   "clients_per_round": cfg.clients_per_round, "rounds": cfg.rounds, "mask_ratio": cfg.mask_ratio,
                   "keep_rounds": cfg.keep_rounds, "keep_clients": cfg.keep_clients,
                   "store_uploads": cfg.store_uploads, "record_truth": cfg.record_truth, "secagg": cfg.secagg,
                   "server_rows": cfg.server_rows},
        "rows_per_client": {"mean": float(np.mean(rows)), "min": min(rows), "max": max(rows),
                            "source": "--images-per-client" if images_per_client else "the run's data plan"},
        "bytes_per_round": {"checkpoint": checkpoint, "per_client": mean, "aggregate": aggregate,
                            "uploads_and_truth_all_clients": round(every_upload / cfg.rounds)},
        "kept": {"checkpoints": list(retention.checkpoints_kept), "rounds": list(retention.rounds_kept),
                 "clients": list(retention.clients_kept), "uploads": sum(map(len, uploads.values()))},
        "projected_bytes": {"checkpoints": checkpoints, "uploads_and_truth": kept_upload_bytes,
                            "total": checkpoints + kept_upload_bytes,
                            "keeping_everything": (cfg.rounds + 1) * checkpoint + every_upload},
        "while_training": {"model_check_copies": cfg.clients * checkpoint if cfg.model_check else 0},
        "server_memory": server_memory(cfg, model, largest_round, max(rows), tokens, width,
                                       round(server_memory_gb * 1e9) if server_memory_gb else physical_memory()),
    }


def size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def plan_lines(plan: dict) -> list[str]:
    """The plan as the command prints it."""
    c, per_round, kept, projected = plan["config"], plan["bytes_per_round"], plan["kept"], plan["projected_bytes"]
    client = per_round["per_client"]
    rows = plan["rows_per_client"]
    return [
        f"{c['model']} {c['method']}, {c['clients']} clients ({c['clients_per_round']} per round), {c['rounds']} "
        f"rounds, uploads kept as {c['store_uploads']}; {rows['mean']:.0f} feature rows per client ({rows['source']})",
        f"per round: checkpoint {size(per_round['checkpoint'])}; per client: update {size(client['update'])}, "
        f"features {size(client['features'])}, heads {size(client['heads'])}, truth {size(client['truth'])}; "
        f"all the round's clients {size(per_round['uploads_and_truth_all_clients'])}",
        *([f"--secagg: no client's update is stored, one sum per kept round ({size(per_round['aggregate'])}); on the "
           "wire each client sends about twice its update (SecAgg+'s 64-bit masked integers and key shares, measured "
           "in docs/secagg.md)"] if c["secagg"] else []),
        f"kept (--keep-rounds {c['keep_rounds']}, --keep-clients {c['keep_clients']}): {len(kept['checkpoints'])} "
        f"checkpoints, {kept['uploads']} client uploads over {len(kept['rounds'])} rounds",
        f"projected run directory: {size(projected['total'])} (checkpoints {size(projected['checkpoints'])}, uploads "
        f"and truth {size(projected['uploads_and_truth'])}); keeping everything: "
        f"{size(projected['keeping_everything'])}",
        f"while it trains (simulation, --model-check): nodes/received holds one model per client, "
        f"{size(plan['while_training']['model_check_copies'])}, removed when the run ends",
        *server_memory_lines(plan["server_memory"]),
    ]


def server_memory_lines(memory: dict | None) -> list[str]:
    if memory is None:
        return ["server memory: this method trains no theta on uploaded features"]
    theta = memory["theta_training"]
    if memory["streams_from_disk"]:
        held = (f"spooled to disk ({size(memory['spool_on_disk'])} under RUN/tmp/ while the round trains) and "
                f"memory-mapped; in memory one client's {memory['rows_held']} rows, its reply and their decoding, "
                f"{size(memory['feature_store'])}")
        verdict = (f"fits in {size(memory['memory'])}" if memory["fits"] else
                   f"does NOT fit in {size(memory['memory'])} (a smaller --images-per-client or --batch-size)")
    else:
        held = (f"held {memory['copies']} times (the decoded uploads and the concatenation; --server-rows disk "
                f"streams them) {size(memory['feature_store'])}")
        verdict = (f"fits in {size(memory['memory'])}" if memory["fits"] else
                   f"does NOT fit in {size(memory['memory'])}: at most {memory['rows_that_fit']} rows do "
                   f"(--server-rows disk, fewer clients per round, a smaller --images-per-client or a larger "
                   f"--mask-ratio)")
    return [f"server memory in its largest round: {memory['rows_in_largest_round']} feature rows of "
            f"{size(memory['bytes_per_row'])}, {held}, and theta's training {size(theta['total'])} (model "
            f"{size(theta['model'])}, gradients and AdamW {size(theta['gradients_and_adamw'])}, activations of a "
            f"batch {size(theta['activations_per_batch'])}): {size(memory['total'])}, {verdict}"]
