"""Image-reconstruction metrics shared by every attack: PSNR, SSIM, LPIPS (named backend), Hungarian
matching, kept-patch scoring and trivial baselines.

Images are float arrays in [0, 1], [N, H, W, 3]. Scores are per image; `summarize` turns them into
{"mean", "std", "n"}. Kept-patch scores use a composite (ground truth outside the kept patches, the
reconstruction inside) so that SSIM windows and LPIPS receptive fields straddling a kept patch's border do not
charge the attack for pixels that were never sent; the SSIM / LPIPS maps are then averaged over kept pixels.
"""

from __future__ import annotations

import socket
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from scipy.ndimage import gaussian_filter
from scipy.optimize import linear_sum_assignment
from skimage.metrics import structural_similarity

# PSNR is capped here: 8-bit quantisation alone leaves 58.9 dB, so anything above is a perfect copy, and the
# cap keeps identical images (inf) and flat crops that a baseline happens to reproduce from dominating means.
MAX_PSNR = 60.0
LPIPS_BACKENDS = ("auto", "lpips-alex", "stlpips-alex")
ALEXNET_WEIGHTS = "alexnet-owt-7be5be79.pth"


class MetricError(ValueError):
    """A metric cannot be computed as asked; the message says how to fix it."""


def _check_pair(recon: np.ndarray, truth: np.ndarray) -> None:
    if recon.shape != truth.shape or recon.ndim != 4 or recon.shape[-1] != 3:
        raise MetricError(f"images must both be [N, H, W, 3]; got {recon.shape} and {truth.shape}")


def psnr(recon: np.ndarray, truth: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Per-image PSNR (data range 1) over all pixels, or over the pixels where weights [N, H, W] > 0."""
    _check_pair(recon, truth)
    err = (recon.astype(np.float64) - truth.astype(np.float64)) ** 2
    if weights is None:
        mse = err.reshape(len(err), -1).mean(axis=1)
    else:
        w = weights[..., None].astype(np.float64)
        mse = (err * w).reshape(len(err), -1).sum(axis=1) / np.maximum(w.reshape(len(w), -1).sum(axis=1) * 3, 1e-12)
    with np.errstate(divide="ignore"):
        values = 10.0 * np.log10(1.0 / mse)
    return np.minimum(values, MAX_PSNR)


def ssim(recon: np.ndarray, truth: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Per-image SSIM (scikit-image, data range 1, channel axis last), optionally the SSIM map's weighted mean."""
    _check_pair(recon, truth)
    values = []
    for r, t, w in zip(recon, truth, weights if weights is not None else [None] * len(recon)):
        score, full = structural_similarity(t.astype(np.float64), r.astype(np.float64), data_range=1.0,
                                            channel_axis=-1, full=True)
        values.append(score if w is None else float((full.mean(axis=-1) * w).sum() / max(w.sum(), 1e-12)))
    return np.asarray(values, dtype=np.float64)


@dataclass
class LPIPS:
    """A perceptual distance with its backend's name, computed at the images' own resolution (the usual
    practice for 32 px data; the spatial map is averaged, or weighted by kept pixels)."""

    name: str
    network: torch.nn.Module

    def __call__(self, recon: np.ndarray, truth: np.ndarray, weights: np.ndarray | None = None,
                 batch_size: int = 64) -> np.ndarray:
        _check_pair(recon, truth)
        values = []
        with torch.no_grad():
            for i in range(0, len(recon), batch_size):
                a, b = (_to_lpips_tensor(x[i:i + batch_size]) for x in (recon, truth))
                spatial = self.network(a, b, normalize=True)[:, 0]  # [n, S, S]
                if weights is None:
                    values.append(spatial.mean(dim=(1, 2)).double().numpy())
                else:
                    w = torch.from_numpy(weights[i:i + batch_size].astype(np.float32))[:, None]
                    w = torch.nn.functional.interpolate(w, size=spatial.shape[-2:], mode="nearest")[:, 0]
                    values.append(((spatial * w).sum(dim=(1, 2)) / w.sum(dim=(1, 2)).clamp_min(1e-12)).double().numpy())
        return np.concatenate(values) if values else np.zeros(0)


def _to_lpips_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)).permute(0, 3, 1, 2)


DOWNLOAD_TIMEOUT_S = 15  # a machine whose network drops packets would otherwise wait minutes for AlexNet


def _standard_lpips() -> torch.nn.Module:
    import lpips  # 1.9 s (torchvision's AlexNet): only where this backend measures

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # torch.hub's download passes no timeout of its own
    try:
        with warnings.catch_warnings():  # lpips still passes torchvision's deprecated `pretrained=True`
            warnings.simplefilter("ignore", UserWarning)
            return lpips.LPIPS(net="alex", spatial=True, verbose=False).eval()
    finally:
        socket.setdefaulttimeout(previous)


def _shift_tolerant_lpips() -> torch.nn.Module:
    from stlpips_pytorch import stlpips  # loads IPython: only where this backend measures

    return stlpips.LPIPS(net="alex", variant="shift_tolerant", spatial=True, verbose=False).eval()


_LOADED: dict[str, LPIPS] = {}


def load_lpips(backend: str = "auto") -> LPIPS:
    """lpips-alex (standard LPIPS v0.1; needs torchvision's AlexNet weights, cached or downloadable) or
    stlpips-alex (shift-tolerant LPIPS, weights shipped with the package, offline). auto prefers lpips-alex."""
    if backend not in LPIPS_BACKENDS:
        raise MetricError(f"unknown LPIPS backend '{backend}': choose {', '.join(LPIPS_BACKENDS)}")
    if backend in _LOADED:
        return _LOADED[backend]
    if backend == "stlpips-alex":
        metric = LPIPS("stlpips-alex", _shift_tolerant_lpips())
    else:
        try:
            metric = LPIPS("lpips-alex", _standard_lpips())
        except Exception as exc:  # urllib / hub errors come in many types
            if backend == "lpips-alex":
                raise MetricError(
                    f"standard LPIPS needs torchvision's AlexNet weights ({ALEXNET_WEIGHTS}) and they are neither in "
                    f"{torch.hub.get_dir()}/checkpoints nor downloadable ({type(exc).__name__}). Copy them there, or "
                    "use --lpips-backend stlpips-alex (weights shipped, works offline)") from None
            print(f"LPIPS: the standard network's AlexNet weights ({ALEXNET_WEIGHTS}) are not in "
                  f"{torch.hub.get_dir()}/checkpoints and could not be downloaded ({type(exc).__name__}): scoring with "
                  "stlpips-alex (shift-tolerant LPIPS, weights shipped); every report names it", file=sys.stderr)
            metric = LPIPS("stlpips-alex", _shift_tolerant_lpips())
    _LOADED[backend] = metric
    return metric


def summarize(values: np.ndarray) -> dict:
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return {"mean": None, "std": None, "median": None, "n": 0}
    return {"mean": float(values.mean()), "std": float(values.std()), "median": float(np.median(values)),
            "n": int(len(values))}


def hungarian_match(recon: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """order such that recon[order[i]] is matched to truth[i], minimising the total MSE (for attacks that do
    not know which reconstruction belongs to which original, e.g. a batch from a gradient)."""
    if len(recon) != len(truth):
        raise MetricError(f"cannot match {len(recon)} reconstructions to {len(truth)} originals")
    rows, cols = linear_sum_assignment(squared_errors(truth, recon))
    return cols[np.argsort(rows)]


def match_to_pool(recon: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """rows such that recon[i] is matched to pool[rows[i]], one-to-one, minimising the total MSE; the pool may
    hold more images than were reconstructed (e.g. a few images recovered from a client's whole update)."""
    if len(recon) > len(pool):
        raise MetricError(f"cannot match {len(recon)} reconstructions to {len(pool)} originals")
    rows, cols = linear_sum_assignment(squared_errors(recon, pool))
    return cols[np.argsort(rows)]


def squared_errors(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[len(a), len(b)] summed squared differences between every pair of images."""
    x = a.reshape(len(a), -1).astype(np.float64)
    y = b.reshape(len(b), -1).astype(np.float64)
    return (x ** 2).sum(1)[:, None] + (y ** 2).sum(1)[None, :] - 2 * x @ y.T


def identifiability_ranks(recon: np.ndarray, truth: np.ndarray, candidates: np.ndarray,
                          weights: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Where each reconstruction's true image ranks among the candidate images by pixel distance (1: its nearest
    neighbour is the true image), and how many distinct candidates there were. The candidates are the true
    images plus `candidates` (the client's other images, public images); repeated images count once, so an
    image uploaded twice does not compete with itself. weights [N, H, W]: compare only where a reconstruction's
    weights are > 0 (the kept patches of its true image: what was sent). The share of rank 1 is the image
    identifiability precision (IIP) of breaching, here in pixel space (the squared error the auditor also matches
    by) rather than LPIPS: cheap over thousands of pairs, and a reconstruction must look like its own image, not
    merely be closer to it than to its neighbours in some learned feature space."""
    pool = distinct_images(np.concatenate([truth, candidates]))
    own = squared_errors(truth, pool).argmin(axis=1)  # each true image's place in the pool
    distances = squared_errors(recon, pool) if weights is None else masked_squared_errors(recon, pool, weights)
    closer = distances < distances[np.arange(len(recon)), own][:, None]
    return 1 + closer.sum(axis=1), len(pool)


def distinct_images(images: np.ndarray) -> np.ndarray:
    """The images with exact repeats removed (first occurrence kept, order kept): by their bytes, which is
    hundreds of times faster than np.unique(axis=0) on thousands of images."""
    flat = np.ascontiguousarray(images).reshape(len(images), -1)
    first = {}
    for index, row in enumerate(flat):
        first.setdefault(row.tobytes(), index)
    return images[sorted(first.values())]


def masked_squared_errors(a: np.ndarray, b: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """[len(a), len(b)] summed squared differences between a[i] and every b[k], over the pixels where
    weights[i] [H, W] > 0 only (every channel), as matrix products: sum m (b - a)^2 = m.b^2 - 2 (m a).b + m.a^2."""
    mask = np.repeat((weights > 0).reshape(len(weights), -1).astype(np.float64), a.shape[-1], axis=1)
    x = a.reshape(len(a), -1).astype(np.float64) * mask
    y = b.reshape(len(b), -1).astype(np.float64)
    return mask @ (y ** 2).T - 2 * x @ y.T + (x ** 2).sum(1)[:, None]


def label_hits(predicted: np.ndarray, true: np.ndarray) -> np.ndarray:
    """bool per predicted label: True if it can be paired with a distinct true label of the same class
    (multiset overlap, order-free: the labels an attack recovers are not tied to particular images)."""
    left = dict(zip(*np.unique(np.asarray(true), return_counts=True)))
    hits = np.zeros(len(predicted), dtype=bool)
    for i, label in enumerate(np.asarray(predicted)):
        if left.get(label, 0) > 0:
            left[label] -= 1
            hits[i] = True
    return hits


def kept_pixels(kept_ids: np.ndarray, image_size: int, patch_size: int) -> np.ndarray:
    """[N, keep] row-major patch ids -> bool [N, H, W], True on the pixels of kept patches."""
    grid = image_size // patch_size
    mask = np.zeros((len(kept_ids), grid * grid), dtype=bool)
    np.put_along_axis(mask, kept_ids.astype(np.int64), True, axis=1)
    mask = mask.reshape(-1, grid, grid)
    return mask.repeat(patch_size, axis=1).repeat(patch_size, axis=2)


def composite(recon: np.ndarray, truth: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The reconstruction on kept pixels, the ground truth elsewhere."""
    return np.where(kept[..., None], recon, truth)


def score(recon: np.ndarray, truth: np.ndarray, lpips: LPIPS, kept: np.ndarray | None = None) -> dict:
    """Per-image scores: {"metrics": {psnr, ssim, lpips}} and, given the kept-pixel masks,
    {"metrics_kept": ...} measured on the kept patches only."""
    result = {"metrics": {"psnr": psnr(recon, truth), "ssim": ssim(recon, truth), "lpips": lpips(recon, truth)}}
    if kept is not None:
        mixed = composite(recon, truth, kept)
        result["metrics_kept"] = {"psnr": psnr(recon, truth, kept), "ssim": ssim(mixed, truth, kept),
                                  "lpips": lpips(mixed, truth, kept)}
    return result


def mean_image_baseline(public_images: np.ndarray, count: int) -> np.ndarray:
    """The attacker who learned nothing guesses the mean auxiliary image for every sample."""
    return np.repeat(public_images.mean(axis=0, keepdims=True), count, axis=0)


def blurred_kept_baseline(truth: np.ndarray, kept: np.ndarray, sigma: float) -> np.ndarray:
    """The kept patches' colours spread by a Gaussian blur (normalised convolution): what an attacker who
    learned only the coarse colour of what was sent would draw."""
    w = kept.astype(np.float64)
    out = np.empty_like(truth, dtype=np.float64)
    spread_w = np.stack([gaussian_filter(x, sigma, mode="nearest") for x in w])
    for c in range(3):
        spread = np.stack([gaussian_filter(x, sigma, mode="nearest") for x in truth[..., c] * w])
        out[..., c] = spread / np.maximum(spread_w, 1e-12)
    return np.clip(out, 0.0, 1.0)

