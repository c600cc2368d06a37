"""The imprint attack ("Robbing the Fed", Fowl et al., ICLR 2022), on the ViT's patch tokens: it reads the update a
client uploads after a round whose model carried the imprint tampering (attacks/tamper.py, --tamper imprint).

Unit j of the imprint (block 0's MLP) fires on tokens brighter than its threshold t_j, and every unit's gradient
for a token is the same scalar g times the token's normalised form u = token / |token|. The thresholds rise with
j, so unit j sums the tokens brighter than t_j, and the difference of units j and j + 1 sums those in bin
[t_j, t_{j+1}). A bin one token fell into holds g u: dividing by its reference coordinate (the constant
IMPRINT_CONSTANT / |token|, whose imprint weight starts at zero) gives the token back exactly, pixels and position
code; the code's nearest sent position code says where the patch was. A bin of several tokens gives a weighted
mix, whose position code is no sent code: the attack keeps the bins whose code decodes within CODE_TOLERANCE.
AdamW's steps are linear in the imprint's tiny gradients (far below its eps), so the sum over the round's steps
is a weighted sum of per-step gradients; bins stay bins, and a patch seen in several epochs stays one patch.

It recovers patches, not whole images (each patch token is binned on its own): every recovered patch comes back
at its position, in an image filled with the prior elsewhere. Applies to the methods whose clients train block 0's
MLP weights (fedavg, eftvit); the imprint's units are that MLP's hidden width, which bounds what one round gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from eftguard.attacks.base import AttackError, ImageReconstruction, Progress, ThreatModel
from eftguard.attacks.gradient import GRADIENT, GradientObservation
from eftguard.attacks.tamper import IMPRINT_BLOCK, IMPRINT_CONSTANT, IMPRINT_TOKEN_SCALE, ImprintLayout

IMPRINT_WEIGHT = f"{IMPRINT_BLOCK}.mlp.fc1.weight"
POSITIONS = "local_module.token_embedding.pos_embed"
CODE_TOLERANCE = 3e-2  # relative distance of a bin's position code to the nearest sent code: one token in the bin


@GRADIENT.register
@dataclass
class ImprintAttack:
    """Each brightness bin of an imprint round's update: the token alone in it, decoded (Fowl et al. 2022)."""

    name = "imprint"
    summary = ("malicious server: read single patches off the binned first-MLP update of an imprint round "
               "(--threat malicious --tamper imprint; Fowl et al. 2022)")
    threat_model: ClassVar[ThreatModel] = ThreatModel(aux_data="public", server="malicious")
    reads: ClassVar[tuple[str, ...]] = (IMPRINT_WEIGHT,)
    tampering: ClassVar[str] = "imprint"  # the round it reads
    observes: ClassVar[tuple[str, ...]] = ("upload",)
    recovers: ClassVar[str] = "patches"  # one patch per reconstruction (kept_ids: its position), not whole images
    steps = 0  # closed form

    def reconstruct(self, obs: GradientObservation, progress: Progress | None = None) -> ImageReconstruction:
        training = obs.local_training
        if training is None or IMPRINT_WEIGHT not in training.uploaded:
            raise AttackError("the imprint attack reads the client's uploaded update: use --observe upload")
        local = obs.model.local_module
        weight = local.patch_embed.proj.weight
        patch, layout = int(weight.shape[-1]), ImprintLayout.of(weight.shape[0], weight[0].numel())
        sent = dict(obs.model.named_parameters())[IMPRINT_WEIGHT].detach().double()
        decay = (1 - training.lr * training.weight_decay) ** training.steps
        summed = sent * decay - training.uploaded[IMPRINT_WEIGHT].double()  # unit j: the tokens brighter than t_j
        bins = summed - torch.cat([summed[1:], torch.zeros_like(summed[:1])])
        reference = bins[:, layout.reference]
        filled = torch.nonzero(reference.abs() > 1e-6 * reference.abs().max().clamp_min(1e-300)).flatten()
        if not len(filled):
            raise AttackError("no imprint unit moved: the client's update holds no token (was the round sent the "
                              "imprint?)")
        tokens = IMPRINT_TOKEN_SCALE * IMPRINT_CONSTANT * bins[filled] / reference[filled, None]
        codes = local.token_embedding.pos_embed[0, 1:, layout.codes].detach().double()
        trained = training.uploaded.get(POSITIONS)  # the codes move a little as the client trains them
        if trained is not None:
            codes = (codes + trained[0, 1:, layout.codes].double()) / 2
        distance = torch.cdist(tokens[:, layout.codes], codes)
        residual, position = distance.min(dim=1)
        residual = residual / codes[position].norm(dim=1)
        single = residual < CODE_TOLERANCE
        chosen = single if single.any() else torch.ones_like(single)  # nothing decodes: every filled bin, as read
        pixels = tokens[chosen, :layout.pixels] / IMPRINT_TOKEN_SCALE
        mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (obs.mean, obs.std))
        patches = (pixels.view(-1, 3, patch, patch) * std + mean).clamp(0, 1).permute(0, 2, 3, 1)  # [n, p, p, 3]
        prior = np.full((obs.image_size, obs.image_size, 3), 0.5) if obs.prior is None else obs.prior
        images = np.repeat(np.asarray(prior, dtype=np.float32)[None], len(patches), axis=0)
        grid = obs.image_size // patch
        for image, at, values in zip(images, position[chosen].tolist(), patches.float().numpy()):
            row, column = divmod(at, grid)
            image[row * patch:(row + 1) * patch, column * patch:(column + 1) * patch] = values
        return ImageReconstruction(images, rows=None, kept_ids=position[chosen].numpy()[:, None],
                                   details={"imprint_units": int(len(bins)), "filled_bins": int(len(filled)),
                                            "single_token_bins": int(single.sum()),
                                            "patches_returned": int(len(images))})
