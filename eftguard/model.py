"""A timm Vision Transformer split into EFTViT's local module, global module and head.

    local module  phi    patch embedding, cls token + positional embedding, first M blocks  (client)
    global module theta  last N blocks + final norm                                        (server)
    head          h      linear classifier on the cls token                                 (both)

Masking happens in the local module's own forward: only the kept patches are embedded (PatchEmbedding), each
with its own position, and the cls token and positional embedding live in a small leaf module (TokenEmbedding):
with that layout per-sample gradients come from hooks on every layer (eftguard.defenses.dp).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch
from torch import nn

from eftguard.paths import input_file_problem


class ModelError(ValueError):
    """A model could not be built or loaded; the message says how to fix it."""


@dataclass(frozen=True)
class ModelPreset:
    timm_name: str
    image_size: int
    patch_size: int
    depth: int  # transformer blocks: --local-layers is checked against it before anything is built
    description: str
    hub_weights: bool = True  # timm's hub has pretrained weights for it (--pretrained)


# eftguard's own timm architecture (timm has no ViT this small): registered with timm by create_timm_vit
MICRO_VIT = "vit_micro_patch4_32"
MICRO_VIT_ARGS = dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2)

PRESETS = {
    "vit-tiny-32": ModelPreset("vit_tiny_patch16_224", 32, 4, 12, "CPU default: 32 px, patch 4, width 192, depth 12"),
    "vit-b16-224": ModelPreset("vit_base_patch16_224", 224, 16, 12, "paper: ViT-B/16, 224 px, width 768, depth 12"),
    "vit-micro-32": ModelPreset(MICRO_VIT, 32, 4, MICRO_VIT_ARGS["depth"],
                                "for smoke tests and CI of a deployment, not for results: 32 px, patch 4, width 64, "
                                "depth 4, 2 heads, 1/25 of vit-tiny-32's parameters, no hub weights",
                                hub_weights=False),
}


def patch_pixels(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, patches, C p p]: patches in row-major order, each patch's pixels in the patch
    convolution's weight order (channel, row, column)."""
    b, c, h, w = images.shape
    rows, cols = h // patch_size, w // patch_size
    patches = images.reshape(b, c, rows, patch_size, cols, patch_size).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, rows * cols, c * patch_size * patch_size)


class PatchProjection(nn.Module):
    """The patch convolution as a matrix product over patch pixels: [B, L, C p p] -> [B, L, D]. Its weight keeps
    the convolution's shape [D, C, p, p], so timm checkpoints load unchanged (key patch_embed.proj.weight)."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias  # the convolution's parameters, shared

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(pixels, self.weight.flatten(1), self.bias)


class PatchEmbedding(nn.Module):
    """timm's PatchEmbed (a convolution with stride = kernel = patch size) that embeds only the patches an image
    keeps: images [B, C, H, W] -> tokens [B, L, D], or [B, keep, D] for the patches in keep_ids. A masked client
    step does not embed the patches it drops (r_m 0.9: 58 of 64 patches)."""

    def __init__(self, timm_patch_embed: nn.Module):
        super().__init__()
        conv = timm_patch_embed.proj
        if not (isinstance(conv, nn.Conv2d) and conv.kernel_size == conv.stride and conv.padding == (0, 0)
                and conv.kernel_size[0] == conv.kernel_size[1] and getattr(timm_patch_embed, "flatten", False)
                and not getattr(timm_patch_embed, "dynamic_img_pad", False)):
            raise ModelError("only ViTs whose patch embedding is a square, non-overlapping convolution can be split")
        self.patch_size, self.img_size = tuple(conv.kernel_size), tuple(timm_patch_embed.img_size)
        self.num_patches = timm_patch_embed.num_patches
        self.proj = PatchProjection(conv)
        self.norm = timm_patch_embed.norm

    def forward(self, images: torch.Tensor, keep_ids: torch.Tensor | None = None) -> torch.Tensor:
        if tuple(images.shape[-2:]) != self.img_size:
            raise ModelError(f"images of {tuple(images.shape[-2:])} pixels given to a model of {self.img_size}: "
                             "resize them, or pick the --model preset of that size")
        pixels = patch_pixels(images, self.patch_size[0])
        if keep_ids is not None:
            pixels = torch.gather(pixels, 1, keep_ids.unsqueeze(-1).expand(-1, -1, pixels.shape[-1]))
        return self.norm(self.proj(pixels))


class TokenEmbedding(nn.Module):
    """cls token and positional embedding, applied to patch tokens: [B, L, D] -> [B, 1 + L, D], or to the kept
    patches' tokens [B, keep, D] (each at its own position, keep_ids) -> [B, 1 + keep, D]."""

    def __init__(self, cls_token: torch.Tensor, pos_embed: torch.Tensor):
        super().__init__()
        self.cls_token = nn.Parameter(cls_token.detach().clone())
        self.pos_embed = nn.Parameter(pos_embed.detach().clone())

    def forward(self, patches: torch.Tensor, keep_ids: torch.Tensor | None = None) -> torch.Tensor:
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(patches.shape[0], -1, -1)
        positions = self.pos_embed[:, 1:]
        if keep_ids is not None:  # index_select: its backward sums in a fixed order on CPU, where advanced
            # indexing's did not with two threads (a resumed run must equal an uninterrupted one bit for bit)
            positions = positions[0].index_select(0, keep_ids.flatten()).view(*keep_ids.shape, -1)
        return torch.cat([cls, patches + positions], dim=1)


class LocalModule(nn.Module):
    """phi: images (optionally masked) -> token features [B, 1 + kept, D]."""

    def __init__(self, patch_embed: nn.Module, token_embedding: TokenEmbedding, norm_pre: nn.Module,
                 blocks: list[nn.Module]):
        super().__init__()
        self.patch_embed = patch_embed
        self.token_embedding = token_embedding
        self.norm_pre = norm_pre
        self.blocks = nn.Sequential(*blocks)
        self.prompt_tokens: nn.Module | None = None  # learned tokens after the cls token (eftguard.peft)

    @property
    def num_patches(self) -> int:
        return self.token_embedding.pos_embed.shape[1] - 1

    def forward(self, images: torch.Tensor, keep_ids: torch.Tensor | None = None) -> torch.Tensor:
        """keep_ids [B, keep]: the patches each image keeps (eftguard.masking); None: every patch, in order."""
        patches = self.patch_embed(images, keep_ids)
        # keep_ids positional and only when given: a forward hook sees it as the layer's second input (per-sample
        # gradients of the positional embedding need it, eftguard.defenses.dp) and would choke on a None
        tokens = self.token_embedding(patches) if keep_ids is None else self.token_embedding(patches, keep_ids)
        if self.prompt_tokens is not None:
            tokens = self.prompt_tokens(tokens)
        return self.blocks(self.norm_pre(tokens))


class GlobalModule(nn.Module):
    """theta: token features -> normalised tokens."""

    def __init__(self, blocks: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.norm = norm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(tokens))


class EFTViT(nn.Module):
    """phi -> theta -> h on the cls token. Full images at inference (keep_ids=None)."""

    def __init__(self, local_module: LocalModule, global_module: GlobalModule, head: nn.Linear, preset: str,
                 mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.local_module = local_module
        self.global_module = global_module
        self.head = head
        self.preset = preset
        self.mean, self.std = tuple(mean), tuple(std)

    @property
    def local_layers(self) -> int:
        return len(self.local_module.blocks)

    def classify(self, tokens: torch.Tensor) -> torch.Tensor:
        """theta and h applied to token features from phi."""
        return self.head(self.global_module(tokens)[:, 0])

    def forward(self, images: torch.Tensor, keep_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.classify(self.local_module(images, keep_ids))

    def normalize(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> normalised float [B, 3, H, W] (contiguous) as the model expects."""
        return self.standardize(images_uint8.permute(0, 3, 1, 2).contiguous().float().div_(255.0))

    def standardize(self, images01: torch.Tensor) -> torch.Tensor:
        """float [B, 3, H, W] in [0, 1] -> the model's input (differentiable, for attacks that optimise pixels)."""
        mean = torch.tensor(self.mean, device=images01.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=images01.device).view(1, 3, 1, 1)
        return (images01 - mean) / std


def check_pretrained(preset_name: str, pretrained: bool) -> None:
    """timm would warn and go on from random weights where a preset has none on the hub: refuse instead."""
    if pretrained and not PRESETS[preset_name].hub_weights:
        raise ModelError(f"--pretrained: the {preset_name} preset has no pretrained weights; drop --pretrained, or "
                         "start from your own with --checkpoint FILE (eftguard pretrain writes one)")


def register_micro_vit() -> None:
    """Register MICRO_VIT with timm, once per process, as timm declares its own ViTs (an entrypoint with its
    architecture and pretrained config): every process that builds a model, Ray workers and SuperNodes included,
    passes here (create_timm_vit)."""
    # timm: 2.4 s, loaded where a model is built (create_timm_vit)
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from timm.models import is_model, register_model
    from timm.models.vision_transformer import _create_vision_transformer

    if is_model(MICRO_VIT):
        return

    def vit_micro_patch4_32(pretrained: bool = False, pretrained_cfg=None, **kwargs) -> nn.Module:
        config = pretrained_cfg or dict(input_size=(3, 32, 32), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
        return _create_vision_transformer(MICRO_VIT, pretrained=pretrained, pretrained_cfg=config,
                                          **dict(MICRO_VIT_ARGS, **kwargs))

    register_model(vit_micro_patch4_32)


def create_timm_vit(preset_name: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    import timm  # 2.4 s: the CLI's start reads the presets, only a model that is built needs timm

    check_pretrained(preset_name, pretrained)
    register_micro_vit()
    preset = PRESETS[preset_name]
    try:
        return timm.create_model(preset.timm_name, pretrained=pretrained, num_classes=num_classes,
                                 img_size=preset.image_size, patch_size=preset.patch_size)
    except Exception as exc:  # hub / network errors come in many types
        if not pretrained:
            raise
        raise ModelError(
            f"could not load pretrained weights for {preset.timm_name} ({type(exc).__name__}: {exc}). "
            "They download from the Hugging Face hub; offline, put them in the hub cache or pass "
            "--checkpoint FILE with local weights"
        ) from exc


def split_timm_vit(vit: nn.Module, local_layers: int, preset: str) -> EFTViT:
    """Move a timm VisionTransformer's parts into the local/global/head split (shares the tensors)."""
    depth = len(vit.blocks)
    check_local_layers(local_layers, depth)
    if getattr(vit, "global_pool", "token") != "token" or getattr(vit, "reg_token", None) is not None \
            or getattr(vit, "no_embed_class", False) or getattr(vit, "attn_pool", None) is not None:
        raise ModelError("only class-token ViTs (global_pool='token', no register tokens) can be split")
    local = LocalModule(PatchEmbedding(vit.patch_embed), TokenEmbedding(vit.cls_token, vit.pos_embed), vit.norm_pre,
                        list(vit.blocks[:local_layers]))
    global_ = GlobalModule(list(vit.blocks[local_layers:]), vit.norm)
    cfg = vit.pretrained_cfg
    return EFTViT(local, global_, vit.head, preset, cfg.get("mean", (0.5,) * 3), cfg.get("std", (0.5,) * 3))


def check_local_layers(local_layers: int, depth: int) -> None:
    if not 1 <= local_layers <= depth - 1:
        raise ModelError(f"--local-layers must be between 1 and {depth - 1} for a depth-{depth} ViT, got {local_layers}")


def build_model(preset: str, num_classes: int, local_layers: int, pretrained: bool = False,
                checkpoint: str | Path | None = None, seed: int = 0,
                adapt: Callable[[EFTViT], None] | None = None) -> EFTViT:
    """The split model: timm initialisation (seeded), pretrained hub weights, or a local checkpoint; then
    adapt (a method's MethodSpec.model_adapter) adds the method's own parameters, seeded too, after the
    checkpoint is loaded: a checkpoint holds the base model only."""
    if preset not in PRESETS:
        raise ModelError(f"unknown model preset '{preset}': choose {', '.join(PRESETS)}")
    os.environ.setdefault("TIMM_FUSED_ATTN", "1")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = split_timm_vit(create_timm_vit(preset, num_classes, pretrained), local_layers, preset)
    if checkpoint is not None:
        load_weights(model, read_state_file(Path(checkpoint)), source=str(checkpoint))
    if adapt is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            adapt(model)
    return model


# --- state dict conversion between timm's flat layout and the split layout ---------------------------------

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.*)$")


def timm_to_split_key(key: str, local_layers: int) -> str:
    if key in ("cls_token", "pos_embed"):
        return f"local_module.token_embedding.{key}"
    if key.startswith(("patch_embed.", "norm_pre.")):
        return f"local_module.{key}"
    if key.startswith("norm."):
        return f"global_module.{key}"
    match = _BLOCK.match(key)
    if match:
        index, rest = int(match.group(1)), match.group(2)
        if index < local_layers:
            return f"local_module.blocks.{index}.{rest}"
        return f"global_module.blocks.{index - local_layers}.{rest}"
    return key  # head.*, and anything foreign (reported by load_weights)


def split_to_timm_key(key: str, local_layers: int) -> str:
    if key.startswith("local_module.token_embedding."):
        return key.removeprefix("local_module.token_embedding.")
    if key.startswith("local_module.blocks."):
        return key.removeprefix("local_module.")
    if key.startswith("local_module."):
        return key.removeprefix("local_module.")
    if key.startswith("global_module.blocks."):
        index, rest = key.removeprefix("global_module.blocks.").split(".", 1)
        return f"blocks.{int(index) + local_layers}.{rest}"
    if key.startswith("global_module."):
        return key.removeprefix("global_module.")
    return key


def to_timm_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A split state dict (any M) in timm's flat layout."""
    local_layers = 1 + max((int(k.split(".")[2]) for k in state if k.startswith("local_module.blocks.")), default=-1)
    return {split_to_timm_key(k, local_layers): v for k, v in state.items()}


def read_state_file(path: Path) -> dict[str, torch.Tensor]:
    """Read weights from .safetensors, or a .pt/.pth/.bin file with torch.load(weights_only=True); every floating
    value finite."""
    problem = input_file_problem(path)
    if problem is not None:
        raise ModelError(f"checkpoint {path} {problem}: give the checkpoint file (.safetensors, or a state dict saved "
                         "with torch.save)")
    try:
        if path.suffix == ".safetensors":
            state = safetensors.torch.load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's own words advise weights_only=False: never here
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200] if path.suffix == ".safetensors" else (
            "not a torch.save file of tensors alone: eftguard unpickles nothing else")
        raise ModelError(f"cannot read checkpoint {path} ({why}): give a .safetensors file or a plain state dict of "
                         "tensors saved with torch.save") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(f"checkpoint {path} is not a state dict of tensors")
    broken = next((k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if broken is not None:  # every upload trained from it would be NaN and dropped, the accuracy that of chance
        raise ModelError(f"checkpoint {path} holds NaN or infinite values (in '{broken}'): give the checkpoint of a "
                         "training that did not diverge")
    return state


def load_weights(model: EFTViT, state: dict[str, torch.Tensor], source: str, strict_head: bool = False) -> None:
    """Load weights in split (any M) or timm layout; shapes must fit the model.

    A head of another class count is skipped with the rest loaded (fine-tuning a pretrained model),
    unless strict_head.
    """
    if any(k.startswith("local_module.") for k in state):
        state = to_timm_state(state)
    state = {timm_to_split_key(k, model.local_layers): v for k, v in state.items()}
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ModelError(f"checkpoint {source} does not fit model {model.preset}: unexpected key '{unknown[0]}' "
                         f"(and {len(unknown) - 1} more)")
    for key, value in list(state.items()):
        if value.shape != own[key].shape:
            if key.startswith("head.") and not strict_head:
                del state[key]
                continue
            raise ModelError(f"checkpoint {source} does not fit model {model.preset}: '{key}' has shape "
                             f"{tuple(value.shape)}, the model needs {tuple(own[key].shape)}. "
                             "Pick the --model preset the checkpoint was trained with")
    missing = sorted(k for k in set(own) - set(state) if not k.startswith("head."))
    if missing:
        raise ModelError(f"checkpoint {source} lacks '{missing[0]}' (and {len(missing) - 1} more) for model {model.preset}")
    model.load_state_dict(state, strict=False)
