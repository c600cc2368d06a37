"""Pretraining the whole ViT on a dataset's public split, the server's own data (never a client's), so that
federated training, and above all the parameter-efficient methods, start from a backbone that has learnt
something. No weights download here, and a ViT trained from scratch on a few thousand images barely learns
without the usual small-data recipe: AdamW with linear warm-up then cosine decay, random resized crops and
flips, label smoothing. The optional MAE objective (reconstruct the pixels of masked patches from the kept
ones, through a light decoder that is discarded afterwards) trains the encoder on exactly the masked inputs
that EFTViT's clients see.

The checkpoint is the encoder and head in timm's flat layout (safetensors), so it loads with
`eftguard train --checkpoint` at any --local-layers M, and into timm itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch
from torch import nn
from torch.nn import functional as F

from eftguard.data import ImageSet
from eftguard.device import computing, placed
from eftguard.errors import ConfigError
from eftguard.masking import random_keep_ids
from eftguard.model import PRESETS, EFTViT, to_timm_state
from eftguard.options import SEED, Bound, at_least, check_values, option
from eftguard.paths import atomic_write, input_file_problem, output_file_problem
from eftguard.schedule import lr_factor

OBJECTIVES = ("supervised", "mae", "both")
MIN_CROP_AREA = 0.35  # random resized crop: fraction of the image area kept, at least
EpochProgress = Callable[[int, int, float], None]  # (step in epoch, steps per epoch, running loss)


class PretrainError(ValueError):
    """Pretraining cannot go on; the message says what to change."""


@dataclass(frozen=True)
class PretrainConfig:
    """Defaults measured on photos (docs/training.md, "Pretrained start"): supervised beat both after 3 epochs."""

    objective: str = option("supervised", "supervised (labels of the public split), mae (reconstruct the pixels of "
                                          "masked patches; no labels needed) or both (their sum)", choices=OBJECTIVES,
                            noun="objective")
    epochs: int = option(3, "passes over the public split", bound=Bound(lambda value: value >= 1, "at least 1"))
    batch_size: int = option(64, "batch size", bound=Bound(lambda value: value >= 1, "at least 1"))
    lr: float = option(1e-3, "peak AdamW learning rate, reached after the warm-up, then cosine decay",
                       bound=Bound(lambda value: value > 0, "a positive number"))
    weight_decay: float = option(0.05, "AdamW weight decay", bound=at_least(0))
    warmup_epochs: int = option(1, "epochs of linear learning-rate warm-up")
    label_smoothing: float = option(0.1, "label smoothing of the supervised loss",
                                    bound=Bound(lambda value: 0 <= value < 1, "in [0, 1)"))
    mask_ratio: float = option(0.75, "fraction of patches the MAE objective hides",
                               bound=Bound(lambda value: 0 < value < 1, "in (0, 1) (fraction of patches the MAE "
                                                                         "objective hides)"))
    augment: bool = option(True, "random resized crops (35-100% of the area) and left-right flips")
    seed: int = option(0, "seed of the initialisation, batches, crops and masks", bound=SEED)

    def check(self) -> None:
        """One ConfigError naming the first bad option: its declaration, then the warm-up within the epochs."""
        check_values(self)
        if not 0 <= self.warmup_epochs < self.epochs:
            raise ConfigError(f"--warmup-epochs must be in [0, --epochs) = [0, {self.epochs}), "
                              f"got {self.warmup_epochs}")

    @property
    def uses_labels(self) -> bool:
        return self.objective in ("supervised", "both")

    @property
    def uses_mae(self) -> bool:
        return self.objective in ("mae", "both")


def random_resized_crop_flip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per image: a random crop of MIN_CROP_AREA..1 of the area, aspect 3/4..4/3, resized back to full size,
    flipped left-right half the time. One batched affine resampling, so it costs next to nothing."""
    count = images.shape[0]

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(count, generator=generator) * (high - low) + low

    area = uniform(MIN_CROP_AREA, 1.0)
    aspect = torch.exp(uniform(math.log(3 / 4), math.log(4 / 3)))
    width, height = (area * aspect).sqrt().clamp(max=1.0), (area / aspect).sqrt().clamp(max=1.0)
    flip = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
    theta = torch.zeros(count, 2, 3)
    theta[:, 0, 0], theta[:, 1, 1] = width * flip, height
    theta[:, 0, 2], theta[:, 1, 2] = uniform(-1, 1) * (1 - width), uniform(-1, 1) * (1 - height)
    grid = F.affine_grid(placed(theta, images.device), list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, 3, H, W] -> [B, patches, p * p * 3], patches in the patch embedding's row-major order."""
    b, c, h, w = images.shape
    rows, cols = h // patch_size, w // patch_size
    patches = images.reshape(b, c, rows, patch_size, cols, patch_size).permute(0, 2, 4, 3, 5, 1)
    return patches.reshape(b, rows * cols, patch_size * patch_size * c)


class PatchDecoder(nn.Module):
    """MAE's light decoder: encoder tokens of the kept patches plus a learnt mask token at every hidden position
    -> pixels of every patch. Only used while pretraining."""

    def __init__(self, width: int, num_patches: int, patch_size: int, dim: int = 128, depth: int = 2, heads: int = 4):
        from timm.models.vision_transformer import Block  # timm (2.3 s): only MAE pretraining builds it

        super().__init__()
        self.embed = nn.Linear(width, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.predict = nn.Linear(dim, patch_size * patch_size * 3)

    def forward(self, tokens: torch.Tensor, keep_ids: torch.Tensor) -> torch.Tensor:
        """tokens [B, 1 + keep, width], keep_ids [B, keep] -> predicted patches [B, patches, p * p * 3]."""
        x = self.embed(tokens)
        num_patches = self.pos_embed.shape[1] - 1
        patches = self.mask_token.expand(x.shape[0], num_patches, -1)
        patches = patches.scatter(1, keep_ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]), x[:, 1:])
        x = torch.cat([x[:, :1], patches], dim=1) + self.pos_embed
        return self.predict(self.norm(self.blocks(x)))[:, 1:]


def mae_loss(model: EFTViT, decoder: PatchDecoder, images: torch.Tensor, mask_ratio: float,
             generator: torch.Generator) -> torch.Tensor:
    """Mean squared error on the hidden patches, each target patch normalised to zero mean and unit variance
    (MAE's normalised-pixel loss)."""
    num_patches = model.local_module.num_patches
    keep_ids = placed(random_keep_ids(images.shape[0], num_patches, mask_ratio, generator), images.device)
    tokens = model.global_module(model.local_module(images, keep_ids))
    predicted = decoder(tokens, keep_ids)
    target = patchify(images, PRESETS[model.preset].patch_size)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6).sqrt()
    hidden = torch.ones(images.shape[0], num_patches, device=images.device)
    hidden.scatter_(1, keep_ids, 0.0)
    return (((predicted - target) ** 2).mean(-1) * hidden).sum() / hidden.sum()


def resume_path(out: Path) -> Path:
    """Where `eftguard pretrain --out OUT` keeps its state after each finished epoch until OUT is written."""
    return out.with_name(out.name + ".resume")


def pretrain(model: EFTViT, public: ImageSet, cfg: PretrainConfig, progress: EpochProgress | None = None,
             epoch_done: Callable[[int, float], None] | None = None, resume: Path | None = None,
             identity: dict[str, str] | None = None) -> list[float]:
    """Train the whole model in place on the public split; returns the mean training loss of every epoch.

    With `resume`, the whole training state is written there after each finished epoch, and a state found there
    is continued from (it must have been written for the same `identity`: dataset, model and recipe), so that an
    interrupted pretraining loses at most the epoch it was in, and ends with the very weights an uninterrupted one
    gives. Stops with a PretrainError when the loss, or the trained model's output, is not finite (nothing is
    saved). Computes on the compute device (eftguard.device); the random choices stay on a CPU generator."""
    cfg.check()
    if len(public) == 0:
        raise PretrainError("the dataset's public split is empty: nothing to pretrain on")
    with computing(model):  # before the optimizer: its state (and a resumed one) lives on the model's device
        return _pretrain(model, public, cfg, progress, epoch_done, resume, identity)


def _pretrain(model: EFTViT, public: ImageSet, cfg: PretrainConfig, progress: EpochProgress | None,
              epoch_done: Callable[[int, float], None] | None, resume: Path | None,
              identity: dict[str, str] | None) -> list[float]:
    generator = torch.Generator().manual_seed(cfg.seed)
    images, labels = torch.from_numpy(public.images), torch.from_numpy(public.labels)
    decoder = None
    if cfg.uses_mae:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            decoder = placed(PatchDecoder(model.head.in_features, model.local_module.num_patches,
                                          PRESETS[model.preset].patch_size))
    params = list(model.parameters()) + (list(decoder.parameters()) if decoder else [])
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(labels) / cfg.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, cfg.warmup_epochs * steps_per_epoch, cfg.epochs * steps_per_epoch, "cosine"))
    modules = {"model": model, "optimizer": optimizer, "schedule": schedule, **({"decoder": decoder} if decoder else {})}
    key = {**(identity or {}), **{k: str(v) for k, v in asdict(cfg).items()}, "public_images": str(len(labels))}
    history = []
    if resume is not None and resume.exists():
        history = load_state(resume, key, modules, generator)
        if epoch_done:
            epoch_done(len(history), history[-1])
    model.train()
    if decoder:
        decoder.train()
    for epoch in range(len(history), cfg.epochs):
        total = 0.0
        for step, batch in enumerate(torch.randperm(len(labels), generator=generator).split(cfg.batch_size)):
            x = model.normalize(placed(images[batch]))
            if cfg.augment:
                x = random_resized_crop_flip(x, generator)
            loss = torch.zeros((), device=x.device)
            if cfg.uses_labels:
                loss = loss + F.cross_entropy(model(x), placed(labels[batch]), label_smoothing=cfg.label_smoothing)
            if decoder:
                loss = loss + mae_loss(model, decoder, x, cfg.mask_ratio, generator)
            if not torch.isfinite(loss):
                raise diverged(f"the loss became {float(loss)} in epoch {epoch + 1}", cfg, resume)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += float(loss.detach())
            if progress:
                progress(step + 1, steps_per_epoch, total / (step + 1))
        history.append(total / steps_per_epoch)
        if resume is not None:
            save_state(resume, key, modules, generator, history)
        if epoch_done:
            epoch_done(epoch + 1, history[-1])
    model.eval()
    with torch.no_grad():
        if not model(model.normalize(placed(images[:cfg.batch_size]))).isfinite().all():
            raise diverged("the trained model's outputs are not finite", cfg, resume)
    return history


def save_state(path: Path, key: dict[str, str], modules: dict, generator: torch.Generator,
               history: list[float]) -> None:
    """Everything the next epoch depends on, written atomically (torch.save of tensors and plain values only)."""
    state = {"format": "eftguard-pretrain-resume", "key": key, "history": history,
             "generator": generator.get_state(), **{name: m.state_dict() for name, m in modules.items()}}
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_state(path: Path, key: dict[str, str], modules: dict, generator: torch.Generator) -> list[float]:
    """Restore what save_state wrote (weights_only: no pickled objects) for the same key; returns the finished
    epochs' losses."""
    try:  # a link to /dev/zero or a named pipe would be read forever: refused before any read
        state = torch.load(path, weights_only=True, map_location="cpu") if input_file_problem(path) is None else None
    except Exception:  # torch's own words would suggest weights_only=False: never for a file found on disk
        state = None
    if not isinstance(state, dict) or state.get("format") != "eftguard-pretrain-resume":
        raise PretrainError(f"{path} cannot be resumed from (not a pretraining state written by eftguard: torn, or "
                            "another file): remove it to start over")
    try:
        if state["key"] != key:
            differs = sorted(k for k in key.keys() | state["key"].keys() if key.get(k) != state["key"].get(k))
            raise PretrainError(f"{path} holds an interrupted pretraining with other settings ({', '.join(differs)}): "
                                "run its own command again to finish it, or remove the file to start this one")
        for name, module in modules.items():
            module.load_state_dict(state[name])
        generator.set_state(state["generator"])
        history = [float(loss) for loss in state["history"]]
        if not 0 < len(history) <= int(key["epochs"]):  # all of them: stopped while the checkpoint was written
            raise ValueError(f"{len(history)} finished epochs of {key['epochs']}")
    except PretrainError:
        raise
    except Exception as exc:  # altered: named, never half-loaded into a run that goes on
        first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise PretrainError(f"{path} cannot be resumed from ({type(exc).__name__}: {first_line}): remove it to "
                            "start over") from None
    return history


def diverged(what: str, cfg: PretrainConfig, resume: Path | None) -> PretrainError:
    """The error to stop with; the kept state is removed, as the changed options it calls for could not use it."""
    if resume is not None:
        resume.unlink(missing_ok=True)
    return PretrainError(f"{what}: lower --lr (now {cfg.lr}) or raise --warmup-epochs")


@torch.no_grad()
def public_loss(model: EFTViT, public: ImageSet, batch_size: int = 256) -> float:
    """Mean cross-entropy of the model on the public split, full unaugmented images."""
    model.eval()
    images, labels = torch.from_numpy(public.images), torch.from_numpy(public.labels)
    total = sum(float(F.cross_entropy(model(model.normalize(images[i:i + batch_size])), labels[i:i + batch_size],
                                      reduction="sum")) for i in range(0, len(labels), batch_size))
    return total / max(len(labels), 1)


def check_out_path(out: Path, force: bool) -> None:
    """Refuse, before any work, an --out the checkpoint cannot be written to."""
    if out.suffix != ".safetensors":
        raise ConfigError(f"--out {out}: the checkpoint is written as safetensors; give a path ending in .safetensors")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: give a file path ending in .safetensors")
    if out.exists() and not force:
        raise ConfigError(f"--out {out} already exists: pick another path, or pass --force to replace it")
    problem = output_file_problem(out, "the checkpoint", makes_folders=True)
    if problem is not None:
        raise ConfigError(f"--out {out} {problem}")


def save_pretrained(model: EFTViT, out: Path, cfg: PretrainConfig, dataset: str, class_names: tuple[str, ...]) -> None:
    """Write the encoder and head in timm's layout, atomically: out holds the whole checkpoint or nothing, and
    an interruption leaves no temporary file behind either."""
    tensors = {k: v.detach().contiguous() for k, v in to_timm_state(model.state_dict()).items()}
    metadata = {"format": "eftguard-pretrained", "model": model.preset, "dataset": dataset,
                "classes": ",".join(class_names), **{k: str(v) for k, v in asdict(cfg).items()}}
    atomic_write(out, lambda path: safetensors.torch.save_file(tensors, str(path), metadata=metadata))
