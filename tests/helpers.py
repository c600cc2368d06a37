"""Helpers that several test files share (fixtures live in conftest.py): reading a report page, what a server
observes of a client's features, the DP noise the gradient attacks are tested under, and a small model that
memorises for the membership tests; what a --secagg run through Flower's runtimes must have stored."""

import json
from html.parser import HTMLParser

import numpy as np
import torch
from torch import nn

from eftguard import metrics
from eftguard.attacks.inversion import ClientFeatures
from eftguard.audit.observe import DPNoise
from eftguard.defenses.dp import client_budget
from eftguard.masking import random_keep_ids
from eftguard.methods import method_spec
from eftguard.rundir import RunDirectory


class Page(HTMLParser):
    """Start tags with attributes, and the text of every table's cells."""

    def __init__(self, text):
        super().__init__()
        self.tags, self.tables, self._cell = [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def sources(self):
        return [v for _, attrs in self.tags for k, v in attrs.items() if k in ("src", "href")]



def markdown_tables(text):
    """Every pipe table of a report.md, cells unescaped as a Markdown viewer shows them."""
    import html

    tables, current = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            if not set(line) <= set("|-"):
                cells = [c.strip().replace("\\|", "|") for c in line.strip("|").split(" | ")]
                current.append([html.unescape(c) for c in cells])
        else:
            current = None
    return tables



METRICS = [{"round": 1, "test_accuracy": 0.31}, {"round": 2, "test_accuracy": 0.42}]


def floats(images_uint8):
    return images_uint8.astype(np.float32) / 255.0



def dp_noise_for_epsilon_1(num_examples=300, batch_size=64):
    """The noise multiplier eftguard.defenses.dp calibrates for epsilon 1 over one epoch of one round."""
    budget = client_budget(1.0, 0.0, "rdp", num_examples, batch_size, 1, (1,))
    return DPNoise(budget.noise_multiplier, 1.0)


def observe(model, images_uint8, mask_ratio, positions_known, seed=0):
    """What a server holds after a client uploads phi(mask(images)) with the model's own local module."""
    generator = torch.Generator().manual_seed(seed)
    keep = random_keep_ids(len(images_uint8), model.local_module.num_patches, mask_ratio, generator)
    with torch.no_grad():
        features = model.local_module(model.normalize(torch.from_numpy(images_uint8)), keep)
    client = ClientFeatures(0, features, torch.zeros(len(features), dtype=torch.long), method_spec("eftvit").uploaded_state(model),
                            keep if positions_known else None)
    return client, keep



def kept_patch_psnr(recon, truth, keep):
    return metrics.psnr(recon, truth, metrics.kept_pixels(keep.numpy(), truth.shape[1], 4))



def mean_image_kept_psnr(photos, truth, keep):
    return kept_patch_psnr(metrics.mean_image_baseline(photos.public.images / 255.0, len(truth)), truth, keep)


# --- membership: a model that memorises, fast -------------------------------------------------------------

class TinyNet(nn.Module):
    """A two-layer perceptron on 12 x 12 images with the two methods the membership attacks call (normalize,
    forward): fast enough to train 17 of them in seconds."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(12 * 12 * 3, 128), nn.ReLU(), nn.Linear(128, 10))

    @staticmethod
    def normalize(images: torch.Tensor) -> torch.Tensor:
        return images.float().div(255).sub(0.5).permute(0, 3, 1, 2)

    def forward(self, x):
        return self.layers(x)


def fitted(images: np.ndarray, labels: np.ndarray, seed: int) -> TinyNet:
    """Full-batch Adam until the training images are memorised: a train-test gap as wide as it gets."""
    model = TinyNet(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = model.normalize(torch.from_numpy(images)), torch.from_numpy(labels)
    for _ in range(100):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


SECURE_RUN = ["--model", "vit-micro-32", "--method", "fed-bias", "--secagg", "--rounds", "1", "--train-samples", "60",
              "--test-samples", "20", "--batch-size", "16"]  # what it checks holds for any model: the micro preset


def check_secure_run(out):
    """A SECURE_RUN's one round: every client in the sum, no per-client update stored, and the model moved by exactly
    the stored aggregate (which is not zero)."""
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["dropped"] == {} and record["secagg"]["cohort"] == list(range(len(record["clients"])))
    run = RunDirectory.open(out)
    assert run.uploaded_partitions(1) == []
    aggregate, before, after = run.load_aggregate(1), run.load_checkpoint(0), run.load_checkpoint(1)
    for key, delta in aggregate.items():
        np.testing.assert_allclose(before[key].numpy() + delta, after[key].numpy(), atol=1e-6)
    assert max(float(np.abs(delta).max()) for delta in aggregate.values()) > 0


def gpus_found(monkeypatch, count):
    """torch finds `count` CUDA GPUs (0: none); nothing runs on them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
