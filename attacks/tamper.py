"""A malicious server's tamperings: crafted weights sent to the clients in one round (`--threat malicious`).

Each tampering is a function `tamper(model_state, cfg, seed) -> model_state` on the split model's state dict (the
model the server would have sent), registered under its name in eftguard.config.TAMPERINGS. The client trains and uploads as usual; the attacks
(`eftguard attack invert --method tampered`, `eftguard attack labels --method tampered`) read what comes back.

- identity-embed: the uploaded tokens become an invertible function of the kept patch pixels. The patch embedding
  is an orthonormal (injective) map of the patch pixels into the embedding width, its bias zero, and the
  positional embeddings a random code in the orthogonal complement of that map (so each token also says where
  it came from); the local blocks' attention and MLP output projections are zeroed, which makes every block the
  identity whatever its LayerNorms hold. The global module's final LayerNorm weight is zeroed too: nothing then
  depends on the input past theta, no gradient reaches phi, and the client's training changes phi only by weight
  decay (a uniform scale), so the map the client uploads is the crafted one.
- stealth-embed: identity-embed with every exact zero and the isometry disguised, so that only a comparison with
  the previous round's model (or a published hash of the first one) tells it from an honest model.
- imprint ("Robbing the Fed", Fowl et al., ICLR 2022, adapted to the ViT's patch tokens): the patch embedding
  writes each token as its patch pixels, their brightness, two constants, a code of its position and a balancing
  coordinate (so the token's mean is zero and the first block's LayerNorm only divides it by its norm); the first
  block's attention is zeroed and its MLP becomes the imprint: hidden unit j fires on tokens brighter than the
  threshold t_j (the thresholds: quantiles of the public patches' brightness), and every unit reads out the same
  tiny vector, so a token's gradient is the same scalar times its (normalised) token in every unit it fires.
  The difference of consecutive units' weight updates is then the sum over the tokens in one brightness bin: a bin
  that one token fell into gives that token, its patch and position, back exactly (attacks/imprint.py). The
  read-out is tiny (IMPRINT_READOUT) so that the gradients stay far below AdamW's eps, where its steps are linear
  in them and the weights the imprint reads start at exactly zero (float32 keeps their small updates whole).
- class-fish (Wen et al., ICML 2022, "Fishing for user data in large-batch federated learning via gradient
  magnification"; class fishing): the head's rows of every class but one (the class the public split holds fewest
  of) are zeroed and their biases set to FISH_LOGIT, so the fished class's probability is 0 for every image: an
  image of another class has no gradient below the head, and the body's update is the gradient of the client's
  images of the fished class alone; with one such image, a batch-1 gradient inversion (attacks/gradient.py,
  `--method fishing`). The fished row is scaled so that one image's body gradient stays near FISH_GRADIENT, far
  below AdamW's eps, where the update is proportional to the gradient (the inversion matches it, not its signs).
- feature-fish (Wen et al. 2022's feature fishing, in one round): the head reads one feature of its input, the one
  that varies most over the public images: the fished class's logit is FEATURE_FISH_SHARPNESS * (feature -
  threshold) per public standard deviation of it, every other logit 0, the threshold the public images' (1 - 1/n)
  quantile of the feature (n: the clients' mean image count, where exactly one of a client's n images above it is
  likeliest). An image of another class whose feature lies below the threshold has (exponentially) no gradient below
  the head; one above it has the magnified gradient of the fished logit, whatever its label, so a client with one
  image above the threshold uploads that image's gradient alone (`--method feature-fishing`). A linear head cannot
  silence every class on both sides: the client's images of the fished class (the public split's rarest) whose
  feature lies below the threshold have a gradient too, of the opposite sign (the fished class's bias update tells
  which side moved the body). The switch must be sharp on the scale of the gaps between one client's images, so the
  gradients sit far above AdamW's eps: the update is AdamW's step of that one gradient (close to its signs), not
  proportional to it as class-fish's is.
- label-probe: the head's input is made one constant vector of tiny entries (final LayerNorm weight 0, bias
  PROBE_SCALE), so that every head-weight gradient is PROBE_SCALE * (p - class fraction of the batch) and so small
  that AdamW, dividing by (sqrt(v) + eps), moves the head weights linearly in it: the head update then measures
  the client's class fractions instead of their signs.

Simulation only: `eftguard train --threat malicious --tamper NAME [--tamper-round R]` exists to measure these
attacks and the client's check (defenses/model_check.py); a deployment refuses it.
"""

from __future__ import annotations

from typing import Callable

import functools
from dataclasses import dataclass

import numpy as np
import torch

from eftguard.config import TAMPERINGS
from eftguard.data.partition import seeded
from eftguard.data.plan import run_dataset
from eftguard.errors import FederationError
from eftguard.model import build_model, patch_pixels

PROBE_SCALE = 1e-10  # label-probe's head input: gradients ~1e-11, far below AdamW's eps (1e-8)
STEALTH_SCALE = 1e-9  # stealth-embed's stand-in for zero
POSITION_CODE_SCALE = 4.0  # norm of each position's code in identity-embed (tokens' pixel part is ~1)
FISH_LOGIT = 1e3  # class-fish: the other classes' logit (Wen et al.'s): the fished class's probability is exactly 0
FISH_GRADIENT = 1e-9  # class-fish: the largest body gradient of one public image of the fished class
# feature-fish: the fished logit's rise per public standard deviation of the feature (an image 0.005 deviations
# beyond the threshold of another is 10 logits apart from it: e^-10 of its gradient)
FEATURE_FISH_SHARPNESS = 2e3
IMPRINT_BLOCK = "local_module.blocks.0"  # the block whose MLP the imprint takes over
IMPRINT_CONSTANT = 1.0  # the value of the imprint token's two constant coordinates
IMPRINT_READOUT = 1e-8  # norm of each imprint unit's read-out: token gradients ~1e-12, far below AdamW's eps
IMPRINT_SHARPNESS = 50.0  # how far (in GELU's input) a unit moves across a median-width bin: on well inside it
IMPRINT_CODE_WIDTH = 16  # coordinates of the position code (fewer where the width leaves fewer)
IMPRINT_CLS_BRIGHTNESS = -5.0  # the cls token's brightness: below every threshold, so it fires no unit
# the tokens' scale: the LayerNorm before the imprint divides it out, while the parameters that make the tokens move
# by at most a few lr per step of the client's training: at 1000 times their usual size that drift is 1e-6 of
# them, so a patch seen in several steps stays one token (within MAX_PARAMETER_VALUE and MAX_FEATURE_VALUE)
IMPRINT_TOKEN_SCALE = 1e3
IMPRINT_MAX_WEIGHT = 5e3  # half the largest parameter the server accepts in an upload (validation.MAX_PARAMETER_VALUE)

Tamper = Callable[[dict[str, torch.Tensor], object, int], dict[str, torch.Tensor]]
TAMPER_FUNCTIONS: dict[str, Tamper] = {}  # the function of each name of TAMPERINGS


class TamperError(ValueError):
    """A tampering cannot be applied to this model; the message says why."""


def tampering(name: str) -> Callable[[Tamper], Tamper]:
    """Registers the function of a tampering that config.TAMPERINGS names (--tamper's choices)."""
    if name not in TAMPERINGS:
        raise ValueError(f"tampering '{name}' is not one of eftguard.config.TAMPERINGS: add it there")

    def register(function: Tamper) -> Tamper:
        TAMPER_FUNCTIONS[name] = function
        return function
    return register


def local_block_indices(state: dict[str, torch.Tensor]) -> list[int]:
    return sorted({int(k.split(".")[2]) for k in state if k.startswith("local_module.blocks.")})


def _check_no_pre_norm(state: dict[str, torch.Tensor]) -> None:
    if any(k.startswith("local_module.norm_pre.") for k in state):
        raise TamperError("identity-embed needs a ViT without a pre-norm LayerNorm (it would drop each token's "
                          "mean and scale)")


@tampering("identity-embed")
def identity_embed(state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    """Tokens = Q · patch pixels + code(position): Q orthonormal columns, codes orthogonal to Q's range."""
    _check_no_pre_norm(state)
    out = dict(state)
    weight = state["local_module.patch_embed.proj.weight"]
    width, pixels = weight.shape[0], weight[0].numel()
    if width <= pixels:
        raise TamperError(f"identity-embed needs an embedding width above the patch's {pixels} pixel values, "
                          f"the model has {width}")
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(width, width, generator=generator, dtype=torch.float64))
    pixel_map, complement = basis[:, :pixels], basis[:, pixels:]
    out["local_module.patch_embed.proj.weight"] = pixel_map.reshape(weight.shape).to(weight.dtype)
    out["local_module.patch_embed.proj.bias"] = torch.zeros(width, dtype=weight.dtype)
    positions = state["local_module.token_embedding.pos_embed"]
    codes = torch.randn(positions.shape[1], width - pixels, generator=generator, dtype=torch.float64)
    codes = POSITION_CODE_SCALE * codes / codes.norm(dim=1, keepdim=True)
    out["local_module.token_embedding.pos_embed"] = (codes @ complement.T).unsqueeze(0).to(positions.dtype)
    for index in local_block_indices(state):
        for part in ("attn.proj", "mlp.fc2"):
            for kind in ("weight", "bias"):
                key = f"local_module.blocks.{index}.{part}.{kind}"
                out[key] = torch.zeros_like(state[key])
    out["global_module.norm.weight"] = torch.zeros_like(state["global_module.norm.weight"])
    return out


@tampering("stealth-embed")
def stealth_embed(state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    """identity-embed kept clear of the client's structural checks: the patch map's columns scaled by 0.5-1.5 (no
    longer an isometry, still injective), and the zeroed weights set to STEALTH_SCALE times their old values
    instead (still near enough to zero that the blocks are the identity and phi gets no usable gradient)."""
    out = identity_embed(state, cfg, seed)
    weight = out["local_module.patch_embed.proj.weight"]
    generator = torch.Generator().manual_seed(seed + 1)
    scales = 0.5 + torch.rand(weight[0].numel(), generator=generator)
    out["local_module.patch_embed.proj.weight"] = (weight.reshape(weight.shape[0], -1) * scales).reshape(weight.shape)
    for key, value in out.items():
        if not value.any() and key.endswith("weight"):
            out[key] = STEALTH_SCALE * state[key]
    return out


@tampering("label-probe")
def label_probe(state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    """The head sees PROBE_SCALE in every coordinate, for every image."""
    out = dict(state)
    norm = state["global_module.norm.weight"]
    out["global_module.norm.weight"] = torch.zeros_like(norm)
    out["global_module.norm.bias"] = torch.full_like(norm, PROBE_SCALE)
    return out


@dataclass(frozen=True)
class ImprintLayout:
    """Where the imprint token keeps what: pixels in 0..P-1, then brightness, the threshold's constant, the
    reference constant (its imprint weights are zero, so its update is read exactly), the position code, and the
    balancing coordinate that makes every token's mean zero."""

    width: int
    pixels: int

    @property
    def brightness(self) -> int:
        return self.pixels

    @property
    def threshold_constant(self) -> int:
        return self.pixels + 1

    @property
    def reference(self) -> int:
        return self.pixels + 2

    @property
    def codes(self) -> slice:
        return slice(self.pixels + 3, self.pixels + 3 + min(IMPRINT_CODE_WIDTH, self.width - self.pixels - 4))

    @property
    def balance(self) -> int:
        return self.codes.stop

    @classmethod
    def of(cls, width: int, pixels: int) -> "ImprintLayout":
        if width < pixels + 6:
            raise TamperError(f"imprint needs an embedding width of at least the patch's {pixels} pixel values + 6, "
                              f"the model has {width}")
        return cls(width, pixels)


@functools.lru_cache(maxsize=2)
def public_patches(dataset: str, data_dir: str, model: str, train_samples: int, seed: int) -> np.ndarray:
    """The run's public images as the model's standardised patch pixels [patches, C p p]: the server's own data,
    which sets the imprint's brightness bins."""
    vit = build_model(model, 10, 1, seed=seed)
    images = torch.from_numpy(run_dataset(dataset, data_dir, model, train_samples, 0, seed).public.images)
    patch = int(vit.local_module.patch_embed.patch_size[0])
    return patch_pixels(vit.normalize(images), patch).flatten(0, 1).double().numpy()


@tampering("imprint")
def imprint(state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    """Token = layout(patch pixels, brightness, constants, position code); block 0's MLP: one unit per brightness
    threshold, each reading out the same IMPRINT_READOUT-sized vector."""
    _check_no_pre_norm(state)
    out = dict(state)
    weight = state["local_module.patch_embed.proj.weight"]
    width, pixels = weight.shape[0], weight[0].numel()
    layout = ImprintLayout.of(width, pixels)
    fc1 = state[f"{IMPRINT_BLOCK}.mlp.fc1.weight"]
    units = fc1.shape[0]
    patches = public_patches(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed)
    brightness = patches.mean(axis=1)
    thresholds = np.quantile(brightness, np.arange(units) / units)
    thresholds[0] -= 1.0  # the darkest public patch fires unit 0 too
    gaps = np.diff(thresholds)
    token_norm = np.median(np.sqrt((patches ** 2).sum(axis=1) + brightness ** 2 + 2 * IMPRINT_CONSTANT ** 2))
    sharpness = min(IMPRINT_SHARPNESS * token_norm / np.sqrt(width) / np.median(gaps[gaps > 0]),
                    IMPRINT_MAX_WEIGHT / max(1.0, np.abs(thresholds).max() / IMPRINT_CONSTANT))

    generator = torch.Generator().manual_seed(seed)
    embed = torch.zeros(width, pixels, dtype=torch.float64)
    embed[:pixels] = torch.eye(pixels, dtype=torch.float64)
    embed[layout.brightness] = 1.0 / pixels
    embed[layout.balance] = -(1.0 + 1.0 / pixels)
    bias = torch.zeros(width, dtype=torch.float64)
    bias[[layout.threshold_constant, layout.reference]] = IMPRINT_CONSTANT
    bias[layout.balance] = -2 * IMPRINT_CONSTANT
    positions = state["local_module.token_embedding.pos_embed"]
    codes = torch.randn(positions.shape[1] - 1, layout.codes.stop - layout.codes.start, generator=generator,
                        dtype=torch.float64)
    codes = codes - codes.mean(dim=1, keepdim=True)  # zero-sum: the token's mean stays zero
    codes = POSITION_CODE_SCALE * codes / codes.norm(dim=1, keepdim=True)
    position_embed = torch.zeros(positions.shape[1:], dtype=torch.float64)
    position_embed[1:, layout.codes] = codes
    cls = torch.zeros(width, dtype=torch.float64)
    cls[layout.brightness] = IMPRINT_CLS_BRIGHTNESS
    cls[[layout.threshold_constant, layout.reference]] = IMPRINT_CONSTANT
    cls[layout.balance] = -IMPRINT_CLS_BRIGHTNESS - 2 * IMPRINT_CONSTANT
    units_in = torch.zeros(units, width, dtype=torch.float64)
    units_in[:, layout.brightness] = sharpness
    units_in[:, layout.threshold_constant] = -sharpness * torch.from_numpy(thresholds) / IMPRINT_CONSTANT
    readout = torch.randn(width, generator=generator, dtype=torch.float64)
    readout = IMPRINT_READOUT * readout / readout.norm()

    def put(key: str, value: torch.Tensor) -> None:
        out[key] = value.reshape(state[key].shape).to(state[key].dtype)

    put("local_module.patch_embed.proj.weight", IMPRINT_TOKEN_SCALE * embed)
    put("local_module.patch_embed.proj.bias", IMPRINT_TOKEN_SCALE * bias)
    put("local_module.token_embedding.pos_embed", IMPRINT_TOKEN_SCALE * position_embed)
    put("local_module.token_embedding.cls_token", IMPRINT_TOKEN_SCALE * cls)
    for part in ("attn.proj.weight", "attn.proj.bias", "mlp.fc1.bias", "mlp.fc2.bias", "norm2.bias"):
        put(f"{IMPRINT_BLOCK}.{part}", torch.zeros_like(state[f"{IMPRINT_BLOCK}.{part}"], dtype=torch.float64))
    put(f"{IMPRINT_BLOCK}.norm2.weight", torch.ones(width, dtype=torch.float64))
    put(f"{IMPRINT_BLOCK}.mlp.fc1.weight", units_in)
    put(f"{IMPRINT_BLOCK}.mlp.fc2.weight", readout[:, None].expand(width, units))
    return out


def fished_class(cfg, classes: int) -> int:
    """The class the class-fish tampering fishes: the one the run's public split holds fewest images of (public;
    the rarer the class, the likelier a client holds one image of it)."""
    public = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public
    return int(np.argmin(np.bincount(public.labels, minlength=classes)[:classes]))


@tampering("class-fish")
def class_fish(state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    """Head rows of every other class 0 with bias FISH_LOGIT; the fished row scaled to FISH_GRADIENT."""
    out = dict(state)
    weight, bias = state["head.weight"], state["head.bias"]
    fished = fished_class(cfg, len(bias))
    out["head.weight"] = torch.zeros_like(weight)
    out["head.weight"][fished] = weight[fished]
    out["head.bias"] = torch.full_like(bias, FISH_LOGIT)
    out["head.bias"][fished] = 0.0
    model = build_model(cfg.model, len(bias), cfg.local_layers, seed=cfg.seed)
    model.load_state_dict(out)
    public = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).public
    images = model.normalize(torch.from_numpy(public.images[:8]))
    body = [p for name, p in model.named_parameters() if not name.startswith("head.")]
    largest = 0.0
    for image in images:
        loss = torch.nn.functional.cross_entropy(model(image[None]), torch.tensor([fished]))
        largest = max(largest, max(float(g.abs().max()) for g in torch.autograd.grad(loss, body)))
    out["head.weight"][fished] *= FISH_GRADIENT / max(largest, 1e-30)
    return out


@torch.no_grad()
def head_inputs(model, images: np.ndarray, chunk: int = 256) -> torch.Tensor:
    """The head's input [images, width] (float64) of uint8 images [N, H, W, 3]."""
    seen = []
    hook = model.head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].double()))
    try:
        for start in range(0, len(images), chunk):
            model(model.normalize(torch.from_numpy(images[start:start + chunk])))
    finally:
        hook.remove()
    return torch.cat(seen)


@dataclass(frozen=True)
class FishedFeature:
    """What feature-fish reads, chosen from the public split alone: the head input's coordinate, the threshold
    above which an image's gradient is switched on, and the coordinate's standard deviation over the public images."""

    index: int
    threshold: float
    spread: float


def fished_feature(cfg, model) -> FishedFeature:
    """The head input coordinate that varies most over the public images, thresholded at their (1 - 1/n) quantile,
    n the clients' mean image count: n q^(n-1) (1 - q), the chance that exactly one of n images lies above the
    q-quantile, peaks at q = 1 - 1/n (about 1/e)."""
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    features = head_inputs(model.eval(), dataset.public.images)
    spreads = features.std(dim=0)
    index = int(spreads.argmax())
    mean_images = max(2.0, len(dataset.train.labels) / cfg.clients)
    threshold = float(torch.quantile(features[:, index], 1 - 1 / mean_images))
    return FishedFeature(index, threshold, float(spreads[index]))


@tampering("feature-fish")
def feature_fish(state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    """The fished class's logit FEATURE_FISH_SHARPNESS * (feature - threshold) / spread, every other one 0: the
    threshold moved into the final LayerNorm's bias of the feature (which only the fished logit reads), so that the
    head's bias stays 0 and its update says whether images above the threshold or the fished class's below it
    moved the body."""
    weight, bias = state["head.weight"], state["head.bias"]
    model = build_model(cfg.model, len(bias), cfg.local_layers, seed=cfg.seed)
    model.load_state_dict(state)
    feature = fished_feature(cfg, model)
    out = dict(state)
    out["head.weight"] = torch.zeros_like(weight)
    out["head.weight"][fished_class(cfg, len(bias)), feature.index] = FEATURE_FISH_SHARPNESS / feature.spread
    out["head.bias"] = torch.zeros_like(bias)
    out["global_module.norm.bias"] = state["global_module.norm.bias"].clone()
    out["global_module.norm.bias"][feature.index] -= feature.threshold
    return out


def tamper_state(name: str, state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    """The state the malicious server sends instead of `state`."""
    if name not in TAMPER_FUNCTIONS:
        raise TamperError(f"unknown tampering '{name}': choose one of {', '.join(TAMPER_FUNCTIONS)}")
    return TAMPER_FUNCTIONS[name](state, cfg, seed)


# --- the server's side: what it sends, round by round (eftguard.federation.server.ServerThreat) ----------------

DRIFT_MARGIN = 0.99  # an adaptive server stays this far inside every bound of the clients' model check
DISGUISE_SCALE = 1e-14  # an adaptive server's stand-in for a weight its tampering zeroes (the check refuses zeros)

Limits = Callable[[int, dict[str, np.ndarray], int], dict[str, np.ndarray]]


def _tamper_or_refuse(name: str, state: dict[str, torch.Tensor], cfg, seed: int) -> dict[str, torch.Tensor]:
    try:
        return tamper_state(name, state, cfg, seed)
    except TamperError as exc:
        raise FederationError(f"--tamper {name}: {exc}") from None


class OneRoundTampering:
    """--threat malicious: the server's own model, except in --tamper-round, when every client gets its tampering."""

    def __init__(self, cfg):
        self.cfg = cfg

    def prepare(self, initial: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
        _tamper_or_refuse(self.cfg.tamper, current, self.cfg, 0)

    def tampering(self, round_number: int) -> str | None:
        return self.cfg.tamper if round_number == self.cfg.tamper_round else None

    def sent(self, round_number: int, partitions: list[int], state: dict[str, torch.Tensor]
             ) -> dict[int, dict[str, torch.Tensor]]:
        if round_number == self.cfg.tamper_round:
            state = _tamper_or_refuse(self.cfg.tamper, state, self.cfg, seeded(self.cfg.seed, round_number, 8))
        return dict.fromkeys(partitions, state)

    def accepted(self, round_number: int, partitions: list[int]) -> None:
        pass


class AdaptiveTampering:
    """--threat adaptive: every round each client gets the model closest to the tampering of the server's own
    model (per coordinate, with the weights it zeroes disguised) that its model check accepts: within DRIFT_MARGIN of the bound from the run's initial
    model and of the bound from the last model it accepted, as the public configuration fixes them (limits). It
    keeps each client's last accepted model in memory: a resumed adaptive run starts them over from the initial
    model's bound alone (the check may then refuse a round, which the metrics record)."""

    def __init__(self, cfg, limits: Limits):
        self.cfg, self.limits = cfg, limits
        self.initial: dict[str, np.ndarray] = {}
        self.last: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self.pending: dict[int, dict[str, np.ndarray]] = {}

    def prepare(self, initial: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
        _tamper_or_refuse(self.cfg.tamper, current, self.cfg, 0)
        self.initial = {k: v.numpy().astype(np.float64) for k, v in initial.items()}

    def tampering(self, round_number: int) -> str | None:
        return self.cfg.tamper

    def sent(self, round_number: int, partitions: list[int], state: dict[str, torch.Tensor]
             ) -> dict[int, dict[str, torch.Tensor]]:
        target = _tamper_or_refuse(self.cfg.tamper, state, self.cfg, seeded(self.cfg.seed, round_number, 8))
        target = disguised({k: v.numpy().astype(np.float64) for k, v in target.items()}, self.initial)
        from_initial = (self.initial, self.limits(round_number, self.initial, round_number - 1))
        out = {}
        for partition in partitions:
            boxes = [from_initial]
            if partition in self.last:
                held_round, held = self.last[partition]
                boxes.append((held, self.limits(round_number, held, round_number - held_round)))
            self.pending[partition] = nearest_within(target, boxes)
            out[partition] = {k: torch.from_numpy(v.astype(np.float32)) for k, v in self.pending[partition].items()}
        return out

    def accepted(self, round_number: int, partitions: list[int]) -> None:
        for partition in partitions:
            self.last[partition] = (round_number, self.pending[partition])
        self.pending.clear()


def disguised(target: dict[str, np.ndarray], initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A tampering aimed at past the model check's structural tells: every weight it zeroes becomes DISGUISE_SCALE
    times the initial weight (not all zero, and still far below anything the tampering's attack notices)."""
    return {k: DISGUISE_SCALE * initial[k] if k.endswith("weight") and not v.any() and initial[k].any() else v
            for k, v in target.items()}


def nearest_within(target: dict[str, np.ndarray], boxes: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]
                   ) -> dict[str, np.ndarray]:
    """Per coordinate, the value closest to target inside every box (centre, half-width), each half-width shrunk to
    DRIFT_MARGIN of itself; rounded to float32 as it is sent."""
    out = {}
    for key, value in target.items():
        low = np.max([centre[key] - DRIFT_MARGIN * width[key] for centre, width in boxes], axis=0)
        high = np.min([centre[key] + DRIFT_MARGIN * width[key] for centre, width in boxes], axis=0)
        out[key] = np.clip(value, low, np.maximum(low, high)).astype(np.float32).astype(np.float64)
    return out


def server_threat(cfg, limits: Limits | None = None):
    """The ServerThreat of a --threat run (None for an honest one); --threat adaptive needs the clients' public
    check bounds (eftguard.federation.client.model_check_limits(cfg))."""
    if cfg.threat == "malicious":
        return OneRoundTampering(cfg)
    if cfg.threat == "adaptive":
        return AdaptiveTampering(cfg, limits)
    return None
