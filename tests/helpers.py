"""Helpers that several test files share (fixtures live in conftest.py): reading a report page, what a server
observes of a client's features, and the DP noise the gradient attacks are tested under."""

from html.parser import HTMLParser

import numpy as np
import torch

from eftguard import metrics
from eftguard.attacks.inversion import ClientFeatures
from eftguard.audit.observe import DPNoise
from eftguard.defenses.dp import client_budget
from eftguard.masking import random_keep_ids
from eftguard.methods import method_spec


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
