"""The optimisation attacks on the case their papers report: the DLG paper's LeNet (sigmoid activations, weights
U(-0.5, 0.5)) and one FedSGD gradient of 32 px images, scored by PSNR against the images and against the mean
image. Shared by experiments/calibration.py (the calibration table of docs/attacks.md) and the tests that hold
each attack to its calibration point. The images are the public split's: no client's data is needed to calibrate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from eftguard import metrics
from eftguard.attacks.gradient import GradientObservation
from eftguard.audit.observe import DPNoise, probe_gradient

IMAGE_SIZE = 32


def lenet(num_classes: int = 10, seed: int = 0) -> nn.Module:
    """The DLG paper's LeNet (Zhu et al. 2019): three 5x5 convolutions of 12 channels with sigmoids, one linear
    layer, every weight drawn from U(-0.5, 0.5)."""
    generator = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 12, 5, padding=2, stride=2), nn.Sigmoid(),
                        nn.Conv2d(12, 12, 5, padding=2, stride=2), nn.Sigmoid(),
                        nn.Conv2d(12, 12, 5, padding=2, stride=1), nn.Sigmoid(),
                        nn.Flatten(), nn.Linear(768, num_classes))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.rand(p.shape, generator=generator) - 0.5)
    return net


@dataclass
class Case:
    """One gradient of LeNet on a few images, what the attacker sees of it, and the truth the auditor keeps."""

    observation: GradientObservation
    images: np.ndarray  # [B, H, W, 3] floats in [0, 1]: the truth
    labels: np.ndarray
    mean_image: np.ndarray  # [H, W, 3]: the baseline's guess


def lenet_case(images_uint8: np.ndarray, labels: np.ndarray, public_uint8: np.ndarray, dp: DPNoise | None = None,
               seed: int = 0) -> Case:
    """One FedSGD gradient of the DLG paper's LeNet on these images (pixels in [0, 1], no normalisation, as in the
    paper); with dp, the DP-SGD step of eftguard.audit.observe (per-sample clipping and Gaussian noise)."""
    net = lenet(seed=seed)
    images = images_uint8.astype(np.float32) / 255.0
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    names = [n for n, _ in net.named_parameters()]
    grads = probe_gradient(net, names, pixels, torch.from_numpy(np.asarray(labels, dtype=np.int64)), None, dp,
                           torch.Generator().manual_seed(seed))
    mean_image = (public_uint8.astype(np.float32) / 255.0).mean(axis=0)
    obs = GradientObservation(net, grads, len(images), IMAGE_SIZE, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0),
                              prior=mean_image, head_bias=names[-1])
    return Case(obs, images, np.asarray(labels), mean_image)


def scored(case: Case, reconstruction: np.ndarray) -> dict[str, float]:
    """Mean PSNR of the reconstructions (matched one to one to the images, as the auditor matches a batch) and of
    the mean image, the baseline."""
    rows = metrics.match_to_pool(reconstruction, case.images)
    baseline = metrics.mean_image_baseline(case.mean_image[None], len(case.images))
    return {"psnr": float(metrics.psnr(reconstruction, case.images[rows]).mean()),
            "baseline_psnr": float(metrics.psnr(baseline, case.images).mean())}
