"""Feature inversion: reconstruct client images from the patch features an EFTViT server receives.

Threat model (docs/threat-model.md): an honest-but-curious server that holds each client's uploaded local module phi_k
(it receives it in the same round), the public architecture and masking code, the run configuration
(mask ratio, feature-release defense) and auxiliary public images. Kept-token positions are not uploaded:
with positions_known the auditor grants them, otherwise the attack infers them from the features
(a position probe trained on auxiliary features, then a monotone assignment: the masking code keeps the
tokens of an upload in increasing position order).

Two attacks of the `invert` family (registry INVERT), `reconstruct(RoundFeatures, progress) ->
{partition: ImageReconstruction}`:
- DecoderInversion (learned inverse network, He et al. 2019): an MAE-style transformer decoder trained on
  auxiliary images pushed through the clients' phi_k with the same masking (and the same feature-release
  clipping and noise); kept tokens go to their positions, learned mask tokens fill the rest, a linear layer
  predicts each patch's pixels.
- OptimizationInversion (white-box rMLE): optimise images so that phi_k(mask(x)) matches the uploaded
  features, with a total-variation prior, Adam and restarts (the best restart per image by feature distance).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from eftguard.attacks.base import ImageReconstruction, Progress, Registry, ThreatModel, total_variation

from eftguard.options import option, whole_number
from eftguard.defenses.feature_dp import clip_rows
from eftguard.defenses.feature_noise import release_features
from eftguard.device import device_of, placed
from eftguard.masking import random_keep_ids
from eftguard.model import EFTViT, LocalModule
from eftguard.precision import PRECISIONS, computing_in

INVERT = Registry("invert", default="decoder")


@dataclass
class ClientFeatures:
    """One client's feature upload as the server holds it."""

    partition: int
    features: torch.Tensor  # [n, 1 + keep, D]: cls token first, then kept tokens in increasing position order
    labels: torch.Tensor  # [n]
    local_state: dict[str, torch.Tensor]  # the client's uploaded phi_k (and h_k), split-layout keys
    kept_ids: torch.Tensor | None = None  # [n, keep]; only under ThreatModel.positions_known


@dataclass
class RoundFeatures:
    """Everything the attacker may use for one round."""

    round_number: int
    clients: list[ClientFeatures]
    model: EFTViT  # architecture and the round's public weights (phi_k of each client is loaded into a copy)
    mask_ratio: float
    aux_images: np.ndarray  # uint8 [N, H, W, 3], the attacker's auxiliary images
    feature_clip: float = 0.0  # the run's feature-release defense, public in config.toml
    feature_noise: float = 0.0  # noise std in units of feature_clip
    clip_per_image: bool = False  # --dp-eps clips each image's row of tokens, --feature-clip each token
    precision: str = "fp32"  # the run's: the clients computed their features in it (eftguard.precision)

    def features_of(self, local: LocalModule, images01: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """phi_k(mask(x)) as a client computes it (in the run's precision), before the release."""
        with computing_in(local, self.precision):
            return local(to_model_input(self.model, images01), keep).float()

    def clipped(self, features: torch.Tensor) -> torch.Tensor:
        """The release's deterministic part: what an upload's features were clipped to."""
        if self.feature_clip <= 0:
            return features
        if self.clip_per_image:
            return clip_rows(features, self.feature_clip)
        return release_features(features, self.feature_clip, 0.0, None)

    def released(self, features: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Features as the run's release would have sent them: clipped, plus its Gaussian noise."""
        clipped = self.clipped(features)
        if self.feature_clip <= 0 or self.feature_noise == 0:
            return clipped
        noise = placed(torch.randn(clipped.shape, generator=generator, dtype=clipped.dtype), clipped.device)
        return clipped + noise * (self.feature_noise * self.feature_clip)


def client_local_module(model: EFTViT, state: dict[str, torch.Tensor]) -> LocalModule:
    """A frozen copy of the round's local module with a client's uploaded phi_k loaded."""
    local = copy.deepcopy(model.local_module)
    own = {k.removeprefix("local_module."): v for k, v in state.items() if k.startswith("local_module.")}
    local.load_state_dict(own)
    return local.eval().requires_grad_(False)


def patch_size_of(local: LocalModule) -> int:
    return local.patch_embed.patch_size[0]


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, H, W, 3] -> [B, L, patch * patch * 3], row-major patches."""
    b, h, w, c = images.shape
    x = images.reshape(b, h // patch, patch, w // patch, patch, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(patches: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, L, patch * patch * 3] -> [B, H, W, 3]."""
    b, length, _ = patches.shape
    grid = int(math.isqrt(length))
    x = patches.reshape(b, grid, grid, patch, patch, 3).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, grid * patch, grid * patch, 3)


def to_model_input(model: EFTViT, images01: torch.Tensor) -> torch.Tensor:
    """float [B, H, W, 3] in [0, 1] -> the model's normalised [B, 3, H, W] (differentiable)."""
    return model.standardize(images01.permute(0, 3, 1, 2))


class AuxFeatures:
    """Batches of auxiliary images with the features phi_k gives them under a fresh mask, cycling over the
    attacked clients' local modules, with the run's feature-release defense applied as the clients do."""

    def __init__(self, round_features: RoundFeatures, locals_: list[LocalModule], generator: torch.Generator):
        self.rf = round_features
        self.locals = locals_
        self.images = torch.from_numpy(round_features.aux_images).float().div_(255.0)
        self.generator = generator
        self.calls = 0

    @torch.no_grad()
    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(images01 [B, H, W, 3], features [B, 1 + keep, D], kept ids [B, keep]) on the local module's device;
        the images, flips and masks drawn on the CPU generator."""
        local = self.locals[self.calls % len(self.locals)]
        self.calls += 1
        index = torch.randint(len(self.images), (size,), generator=self.generator)
        images = self.images[index]
        flip = torch.rand(size, generator=self.generator) < 0.5
        images = torch.where(flip.view(-1, 1, 1, 1), images.flip(2), images)
        keep = random_keep_ids(size, local.num_patches, self.rf.mask_ratio, self.generator)
        images, keep = placed(images, device_of(local)), placed(keep, device_of(local))
        return images, self.rf.released(self.rf.features_of(local, images, keep), self.generator), keep


class PositionProbe(nn.Module):
    """token feature -> log-probabilities of its patch position (trained on auxiliary features)."""

    def __init__(self, width: int, num_patches: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.linear = nn.Linear(width, num_patches)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.linear(self.norm(tokens)), dim=-1)

    def loss(self, features: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        logp = self(features[:, 1:])
        return nn.functional.nll_loss(logp.reshape(-1, logp.shape[-1]), keep.reshape(-1))

    @torch.no_grad()
    def infer(self, features: torch.Tensor) -> torch.Tensor:
        return monotone_assignment(self(features[:, 1:]))


def monotone_assignment(logp: torch.Tensor) -> torch.Tensor:
    """The most likely strictly increasing positions for each sample's tokens (dynamic programming).

    logp [B, K, L] -> positions [B, K]; token k can only sit at positions k .. L - K + k."""
    b, k, length = logp.shape
    score = logp[:, 0].clone()
    score[:, length - k + 1:] = -math.inf
    back = []
    for i in range(1, k):
        best, arg = torch.cummax(score, dim=1)  # best over positions <= j
        prev = torch.full_like(score, -math.inf)
        prev[:, 1:] = best[:, :-1]
        prev_arg = torch.zeros_like(arg)
        prev_arg[:, 1:] = arg[:, :-1]
        score = prev + logp[:, i]
        score[:, :i] = -math.inf
        score[:, length - k + i + 1:] = -math.inf
        back.append(prev_arg)
    positions = torch.empty(b, k, dtype=torch.long, device=logp.device)
    positions[:, -1] = score.argmax(dim=1)
    for i in range(k - 1, 0, -1):
        positions[:, i - 1] = back[i - 1].gather(1, positions[:, i:i + 1])[:, 0]
    return positions


class InversionDecoder(nn.Module):
    """MAE-style decoder: token features at their positions (mask tokens elsewhere) -> per-patch pixels."""

    def __init__(self, feature_width: int, num_patches: int, patch: int, width: int, depth: int, heads: int = 4):
        from timm.models.vision_transformer import Block  # timm (2.3 s): only the decoder attack builds it

        super().__init__()
        self.patch = patch
        self.in_norm = nn.LayerNorm(feature_width, elementwise_affine=False)  # features of deep blocks grow large
        self.embed = nn.Linear(feature_width, width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, 1 + num_patches, width) * 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads, mlp_ratio=4.0) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.pixels = nn.Linear(width, patch * patch * 3)

    def forward(self, features: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """features [B, 1 + keep, D], keep [B, keep] -> images [B, H, W, 3] (unclamped, ~[0, 1])."""
        tokens = self.embed(self.in_norm(features))
        b, num_patches = tokens.shape[0], self.pos.shape[1] - 1
        slots = self.mask_token.to(tokens.dtype).expand(b, num_patches, -1).clone()  # bf16 under autocast
        slots.scatter_(1, keep.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]), tokens[:, 1:])
        x = torch.cat([tokens[:, :1], slots], dim=1) + self.pos
        x = self.norm(self.blocks(x))
        return unpatchify(self.pixels(x[:, 1:]), self.patch)


def _cosine_lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def train_position_probe(aux: AuxFeatures, width: int, num_patches: int, steps: int, batch_size: int, seed: int,
                         progress: Progress | None = None) -> PositionProbe:
    with torch.random.fork_rng(devices=[]):  # seeded initialisation without touching the caller's RNG
        torch.manual_seed(seed)
        probe = placed(PositionProbe(width, num_patches), device_of(aux.locals[0]))  # where aux's batches are
    optimizer = torch.optim.Adam(probe.parameters(), lr=1e-2)
    for step in range(steps):
        _, features, keep = aux.batch(batch_size)
        loss = probe.loss(features, keep)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if progress:
            progress("position probe", step + 1, steps)
    return probe.eval()


def _positions(client: ClientFeatures, probe: PositionProbe | None) -> torch.Tensor:
    return client.kept_ids if probe is None else probe.infer(placed(client.features, device_of(probe))).cpu()


@INVERT.register
@dataclass
class DecoderInversion:
    """Learned inverse network; one decoder per round, trained across the attacked clients' phi_k."""

    name = "decoder"
    summary = ("train an inverse network on auxiliary images pushed through each client's uploaded local module "
               "with the same masking, then apply it to the uploads")
    threat_model: ThreatModel = field(default_factory=ThreatModel)
    steps: int = option(1000, "decoder training steps", whole_number(1))
    batch_size: int = 32
    lr: float = 1e-3
    width: int = 128
    depth: int = 2
    probe_steps: int = 300
    seed: int = 0
    precision: str = option("fp32", "of the decoder's training and inference: fp32, or bf16 (bfloat16 matrix "
                                    "products; its steps 2.3x faster on AMX tiles, 1.8x with AVX-512 BF16; the same "
                                    "figures on the demo's run: docs/attacks.md)", str, choices=PRECISIONS)

    def reconstruct(self, observation: RoundFeatures, progress: Progress | None = None
                    ) -> dict[int, ImageReconstruction]:
        generator = torch.Generator().manual_seed(self.seed)
        # on the compute device (eftguard.device): the copies of phi_k, the probe and the decoder; CPU results
        locals_ = [placed(client_local_module(observation.model, c.local_state)) for c in observation.clients]
        aux = AuxFeatures(observation, locals_, generator)
        local = locals_[0]
        width, num_patches, patch = observation.clients[0].features.shape[-1], local.num_patches, patch_size_of(local)
        probe = None if self.threat_model.positions_known else train_position_probe(
            aux, width, num_patches, self.probe_steps, self.batch_size, self.seed, progress)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            decoder = placed(InversionDecoder(width, num_patches, patch, self.width, self.depth), device_of(local))
        optimizer = torch.optim.AdamW(decoder.parameters(), lr=self.lr, weight_decay=0.05)
        decoder.train()
        final_loss = math.nan
        for step in range(self.steps):
            for group in optimizer.param_groups:
                group["lr"] = _cosine_lr(step, self.steps, self.lr, warmup=min(100, self.steps // 10 + 1))
            images, features, keep = aux.batch(self.batch_size)
            with computing_in(decoder, self.precision):
                predicted = decoder(features, keep).float()
            loss = nn.functional.mse_loss(predicted, images)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            final_loss = float(loss.detach())
            if progress:
                progress("decoder", step + 1, self.steps)
        decoder.eval()
        results = {}
        with torch.no_grad(), computing_in(decoder, self.precision):
            for client in observation.clients:
                keep = _positions(client, probe)
                images = torch.cat([decoder(placed(f, device_of(local)), placed(k, device_of(local))).float().cpu()
                                    for f, k in zip(client.features.split(256), keep.split(256))])
                results[client.partition] = ImageReconstruction(
                    images.clamp(0, 1).numpy(), rows=np.arange(len(images)), kept_ids=keep.numpy(),
                    details={"decoder_train_mse": final_loss})
        return results


@INVERT.register
@dataclass
class OptimizationInversion:
    """White-box rMLE: images whose features under phi_k match the upload, with a TV prior."""

    name = "optimize"
    summary = "find images whose features match the uploads (total-variation prior, Adam, restarts)"
    threat_model: ThreatModel = field(default_factory=ThreatModel)
    steps: int = option(300, "optimisation steps per restart", whole_number(1))
    restarts: int = option(2, "random restarts per image, the best feature match wins", whole_number(1))
    lr: float = 0.1
    tv_weight: float = 0.05
    probe_steps: int = 300
    batch_size: int = 64
    seed: int = 0

    def feature_distance(self, local: LocalModule, observation: "RoundFeatures", images01: torch.Tensor,
                         keep: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per image: squared feature error relative to the target's energy. The release's clipping is
        deterministic, so the candidate's features are clipped the same way."""
        features = observation.clipped(observation.features_of(local, images01, keep))
        return ((features - target) ** 2).sum(dim=(1, 2)) / (target ** 2).sum(dim=(1, 2)).clamp_min(1e-12)

    def reconstruct(self, observation: RoundFeatures, progress: Progress | None = None
                    ) -> dict[int, ImageReconstruction]:
        generator = torch.Generator().manual_seed(self.seed)
        locals_ = [client_local_module(observation.model, c.local_state) for c in observation.clients]
        probe = None
        if not self.threat_model.positions_known:
            aux = AuxFeatures(observation, locals_, generator)
            probe = train_position_probe(aux, observation.clients[0].features.shape[-1], locals_[0].num_patches,
                                         self.probe_steps, self.batch_size, self.seed, progress)
        mean_image = torch.from_numpy(observation.aux_images).float().div(255.0).mean(0).clamp(0.02, 0.98)
        total = len(observation.clients) * self.restarts * self.steps
        done = 0
        results = {}
        for client, local in zip(observation.clients, locals_):
            keep = _positions(client, probe)
            target = client.features
            best_images = torch.zeros(len(target), *mean_image.shape)
            best_distance = torch.full((len(target),), math.inf)
            for _ in range(self.restarts):
                noise = torch.randn(len(target), *mean_image.shape, generator=generator) * 0.5
                logits = (torch.logit(mean_image) + noise).requires_grad_(True)
                optimizer = torch.optim.Adam([logits], lr=self.lr)
                for step in range(self.steps):
                    for group in optimizer.param_groups:
                        group["lr"] = _cosine_lr(step, self.steps, self.lr, warmup=1)
                    images = torch.sigmoid(logits)
                    distance = self.feature_distance(local, observation, images, keep, target)
                    loss = (distance + self.tv_weight * total_variation(images.permute(0, 3, 1, 2))).sum()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    done += 1
                    if progress:
                        progress("optimisation", done, total)
                with torch.no_grad():
                    images = torch.sigmoid(logits)
                    distance = self.feature_distance(local, observation, images, keep, target)
                    better = distance < best_distance
                    best_images[better] = images[better]
                    best_distance[better] = distance[better]
            results[client.partition] = ImageReconstruction(
                best_images.numpy(), rows=np.arange(len(target)), kept_ids=keep.numpy(),
                details={"relative_feature_distance": float(best_distance.mean())})
        return results


@INVERT.register
@dataclass
class TamperedInversion:
    """Closed-form inverse of a tampered round (attacks/tamper.py, identity-embed): with the local blocks reduced to
    the identity, each uploaded token is W x + b + pos_i for its patch pixels x and position i, W, b and pos read
    off the client's uploaded phi_k. The position is the one whose embedding leaves the smallest residual outside
    W's range; the pixels are the least-squares solution. On an honest round the same inverse reads noise."""

    name = "tampered"
    summary = ("malicious server: invert the patch embedding of a tampered round (--threat malicious --tamper "
               "identity-embed) by least squares; positions decoded from the tokens")
    threat_model: ClassVar[ThreatModel] = ThreatModel(aux_data=None, server="malicious")
    steps = 0  # closed form

    def reconstruct(self, observation: RoundFeatures, progress: Progress | None = None
                    ) -> dict[int, ImageReconstruction]:
        mean_image = torch.from_numpy(observation.aux_images).float().div(255.0).mean(0)
        results = {}
        for done, client in enumerate(observation.clients):
            local = client_local_module(observation.model, client.local_state)
            images, keep, residual = invert_patch_embedding(observation.model, local, client.features, mean_image)
            results[client.partition] = ImageReconstruction(
                images.numpy(), rows=np.arange(len(images)), kept_ids=keep.numpy(),
                details={"relative_residual": residual})
            if progress:
                progress("inverse", done + 1, len(observation.clients))
        return results


def invert_patch_embedding(model: EFTViT, local: LocalModule, features: torch.Tensor, fill: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(images [n, H, W, 3] in [0, 1] with fill where no token was sent, kept positions [n, keep], the mean
    relative residual of the tokens outside the embedding's range plus their position)."""
    weight = local.patch_embed.proj.weight.double()
    patch, width = weight.shape[-1], weight.shape[0]
    embed = weight.reshape(width, -1)  # [D, 3 p p], columns in the conv's (channel, row, column) order
    tokens = features[:, 1:].double() - local.patch_embed.proj.bias.double()  # [n, keep, D]
    positions = local.token_embedding.pos_embed[0, 1:].double()  # [L, D]
    outside = torch.eye(width, dtype=torch.float64) - embed @ torch.linalg.pinv(embed)  # projector off W's range
    distance = torch.cdist((tokens @ outside).flatten(0, 1), positions @ outside)  # [n keep, L]
    keep = distance.argmin(dim=1).view(tokens.shape[:2])
    residual = float((distance.min(dim=1).values / tokens.flatten(0, 1).norm(dim=1).clamp_min(1e-12)).mean())
    pixels = torch.linalg.lstsq(embed, (tokens - positions[keep]).flatten(0, 1).T).solution.T  # [n keep, 3 p p]
    fill_patches = patchify(fill.unsqueeze(0), patch)[0]  # [L, p p 3]
    mean, std = torch.tensor(model.mean, dtype=torch.float64), torch.tensor(model.std, dtype=torch.float64)
    sent = pixels.view(-1, 3, patch, patch).permute(0, 2, 3, 1) * std + mean  # standardised -> [0, 1], (p, p, 3)
    patches = fill_patches.expand(len(tokens), -1, -1).clone()
    patches.scatter_(1, keep.unsqueeze(-1).expand(-1, -1, patches.shape[-1]),
                     sent.reshape(len(tokens), keep.shape[1], -1).float())
    images = unpatchify(patches, patch).clamp(0, 1)
    return images, keep, residual
