"""Image-reconstruction metrics shared by every attack: PSNR, SSIM, CW-SSIM, LPIPS (named backend), Hungarian
matching, identifiability, kept-patch scoring and trivial baselines.

Images are float arrays in [0, 1], [N, H, W, 3]. Scores are per image; `summarize` turns them into
{"mean", "std", "n"}. Kept-patch scores use a composite (ground truth outside the kept patches, the
reconstruction inside) so that SSIM windows and LPIPS receptive fields straddling a kept patch's border do not
charge the attack for pixels that were never sent; the SSIM / LPIPS maps are then averaged over kept pixels.
"""

from __future__ import annotations

import socket
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.ndimage import gaussian_filter
from scipy.optimize import linear_sum_assignment
from skimage.metrics import structural_similarity

# PSNR is capped here: 8-bit quantisation alone leaves 58.9 dB, so anything above is a perfect copy, and the
# cap keeps identical images (inf) and flat crops that a baseline happens to reproduce from dominating means.
MAX_PSNR = 60.0
# CW-SSIM (Sampat et al. 2009): complex steerable pyramid (pyrtools, Simoncelli's lab) with 4 orientations, every
# level whose band holds a 7 x 7 window (32 px: 32, 16 and 8 px), a small stabiliser K for images in [0, 1].
CW_SSIM_ORIENTATIONS = 4
CW_SSIM_WINDOW = 7
CW_SSIM_K = 1e-6
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


def cw_ssim(recon: np.ndarray, truth: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Per-image complex-wavelet SSIM (Sampat, Wang, Gupta, Bovik & Markey, IEEE TIP 2009): in every subband of a
    complex steerable pyramid, (2 |sum_w x conj(y)| + K) / (sum_w |x|^2 + sum_w |y|^2 + K) over 7 x 7 windows w,
    averaged over windows, then over subbands (levels and orientations) and colour channels. A small translation
    turns the coefficients' phases alike within a window, which the magnitude of the sum ignores: CW-SSIM
    tolerates the shifts that SSIM punishes. weights [N, H, W]: each map's mean weighted by the weights averaged
    over the pixels under each window (kept patches)."""
    _check_pair(recon, truth)
    values = []
    for i, (r, t) in enumerate(zip(recon, truth)):
        maps = []
        for c in range(r.shape[-1]):
            for x, y in zip(_subbands(_channel_key(r[..., c])), _subbands(_channel_key(t[..., c]))):
                cross = np.abs(_window_sum(x * y.conj()))
                maps.append((2 * cross + CW_SSIM_K) / (_window_sum(np.abs(x) ** 2 + np.abs(y) ** 2) + CW_SSIM_K))
        if weights is None:
            values.append(np.mean([m.mean() for m in maps]))
        else:
            window_weights = [_window_sum(_block_mean(weights[i].astype(np.float64), _band_shape(m))) for m in maps]
            values.append(np.mean([(m * w).sum() / max(w.sum(), 1e-12) for m, w in zip(maps, window_weights)]))
    return np.asarray(values, dtype=np.float64)


def _channel_key(channel: np.ndarray) -> tuple[bytes, tuple[int, int]]:
    return np.ascontiguousarray(channel, dtype=np.float64).tobytes(), channel.shape


@lru_cache(maxsize=512)  # the originals and the mean image recur across the score groups of one scoring (86 kB each)
def _subbands(key: tuple[bytes, tuple[int, int]]) -> tuple[np.ndarray, ...]:
    """The complex subbands of one image channel that hold a CW-SSIM window, finest level first."""
    from pyrtools.pyramids import SteerablePyramidFreq  # only where CW-SSIM is scored

    data, shape = key
    pyramid = SteerablePyramidFreq(np.frombuffer(data).reshape(shape), height="auto",
                                   order=CW_SSIM_ORIENTATIONS - 1, is_complex=True)
    return tuple(band for k, band in pyramid.pyr_coeffs.items()
                 if isinstance(k, tuple) and min(band.shape) >= CW_SSIM_WINDOW)


def _window_sum(values: np.ndarray) -> np.ndarray:
    """Sums over every 7 x 7 window inside the band (valid positions only), from a summed-area table."""
    table = np.pad(values, ((1, 0), (1, 0))).cumsum(axis=0).cumsum(axis=1)
    n = CW_SSIM_WINDOW
    return table[n:, n:] - table[:-n, n:] - table[n:, :-n] + table[:-n, :-n]


def _band_shape(window_map: np.ndarray) -> tuple[int, int]:
    return window_map.shape[0] + CW_SSIM_WINDOW - 1, window_map.shape[1] + CW_SSIM_WINDOW - 1


def _block_mean(weights: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """weights [H, W] averaged over the blocks that cover a band of `shape` (edges repeated where H is not a
    multiple)."""
    fy, fx = -(-weights.shape[0] // shape[0]), -(-weights.shape[1] // shape[1])
    padded = np.pad(weights, ((0, shape[0] * fy - weights.shape[0]), (0, shape[1] * fx - weights.shape[1])),
                    mode="edge")
    return padded.reshape(shape[0], fy, shape[1], fx).mean(axis=(1, 3))


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

    def embed(self, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
        """[N, D] vectors whose squared Euclidean distances are LPIPS distances (each layer's map averaged at its own
        resolution, LPIPS' non-spatial form): LPIPS is a sum over layers of the mean over positions of
        sum_c w_c (f_c(a) - f_c(b))^2 on unit-normalised features f, w_c >= 0, so each image's features scaled by
        sqrt(w_c / positions) are its coordinates. Thousands of pairs then cost one network pass per image."""
        net = self.network
        out = []
        with torch.no_grad():
            for i in range(0, len(images), batch_size):
                x = net.scaling_layer(2 * _to_lpips_tensor(images[i:i + batch_size]) - 1)
                parts = []
                for layer, features in enumerate(net.net.forward(x)):
                    unit = features / (features.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
                    positions = unit.shape[2] * unit.shape[3]
                    scale = net.lins[layer].model[-1].weight.clamp_min(0).sqrt() / np.sqrt(positions)
                    parts.append((unit * scale).flatten(1))
                out.append(torch.cat(parts, dim=1).numpy())
        return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


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
                          weights: np.ndarray | None = None, space: Callable[[np.ndarray], np.ndarray] | None = None,
                          competes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where each reconstruction's true image ranks among its candidate images by distance (1: its nearest neighbour
    is the true image), and how many distinct candidates each had. The candidates are the true images plus
    `candidates` (the client's other images, public images); repeated images count once, so an image uploaded twice
    does not compete with itself. competes [N, len(candidates)]: which of `candidates` compete with reconstruction i
    (same-label public images, as the field draws them; default all; the true images always do). The share of rank 1
    is the image identifiability precision (IIP) of Yin et al. 2021 as breaching computes it.

    Distance: squared pixel error (the auditor's matching), or over the pixels where weights [N, H, W] > 0 (the kept
    patches of the true image: what was sent); or, given `space` (images -> [N, D] vectors), squared Euclidean
    distance between the vectors: LPIPS.embed, or a model's unit-normalised features (1 - cosine, up to a factor)."""
    pool, index = distinct_images(np.concatenate([truth, candidates]), with_index=True)
    own = squared_errors(truth, pool).argmin(axis=1)  # each true image's place in the pool
    allowed = np.ones((len(recon), len(truth) + len(candidates)), dtype=bool)
    if competes is not None:
        allowed[:, len(truth):] = competes
    allowed = allowed[:, index]
    used = allowed.any(axis=0)  # a candidate no reconstruction competes with is neither embedded nor compared
    pool, allowed, own = pool[used], allowed[:, used], (np.cumsum(used) - 1)[own]
    if weights is not None:
        if space is not None:
            raise MetricError("kept-patch weights compare pixels: give weights or a space, not both")
        distances = masked_squared_errors(recon, pool, weights)
    else:
        distances = squared_errors(recon, pool) if space is None else embedded_squared_errors(space, recon, pool)
    closer = (distances < distances[np.arange(len(recon)), own][:, None]) & allowed
    return 1 + closer.sum(axis=1), allowed.sum(axis=1)


def embedded_squared_errors(space: Callable[[np.ndarray], np.ndarray], a: np.ndarray, b: np.ndarray,
                            chunk: int = 256) -> np.ndarray:
    """squared_errors between the vectors `space` maps a and b to, b embedded a chunk at a time: an LPIPS
    embedding is 36 288 numbers per 32 px image, and a pool holds thousands of public images."""
    vectors = space(a)
    return np.concatenate([squared_errors(vectors, space(b[i:i + chunk])) for i in range(0, len(b), chunk)], axis=1)


def distinct_images(images: np.ndarray, with_index: bool = False):
    """The images with exact repeats removed (first occurrence kept, order kept): by their bytes, which is
    hundreds of times faster than np.unique(axis=0) on thousands of images. with_index: also their indices."""
    flat = np.ascontiguousarray(images).reshape(len(images), -1)
    first = {}
    for index, row in enumerate(flat):
        first.setdefault(row.tobytes(), index)
    kept = np.array(sorted(first.values()), dtype=np.int64)
    return (images[kept], kept) if with_index else images[kept]


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
    """Per-image scores: {"metrics": {psnr, ssim, cw_ssim, lpips}} and, given the kept-pixel masks,
    {"metrics_kept": ...} measured on the kept patches only."""
    result = {"metrics": {"psnr": psnr(recon, truth), "ssim": ssim(recon, truth), "cw_ssim": cw_ssim(recon, truth),
                          "lpips": lpips(recon, truth)}}
    if kept is not None:
        mixed = composite(recon, truth, kept)
        result["metrics_kept"] = {"psnr": psnr(recon, truth, kept), "ssim": ssim(mixed, truth, kept),
                                  "cw_ssim": cw_ssim(mixed, truth, kept), "lpips": lpips(mixed, truth, kept)}
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

