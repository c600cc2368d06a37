"""The app's model and data: a small CNN and a folder of local images (one subfolder per class)."""

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

IMAGE_SIZE = 16
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)


class Net(nn.Module):
    """Two strided sigmoid convolutions and a linear classifier (LeNet-like, as in DLG's experiments)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 12, 5, stride=2, padding=2), nn.Sigmoid(),
                                      nn.Conv2d(12, 12, 5, stride=2, padding=2), nn.Sigmoid())
        self.classifier = nn.Linear(12 * (IMAGE_SIZE // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def load_partition(data_dir: str, partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """This client's share of the images (every num_partitions-th file): uint8 [n, H, W, 3] and labels [n]."""
    classes = sorted(p.name for p in Path(data_dir).iterdir() if p.is_dir())
    files = sorted((f, label) for label, name in enumerate(classes) for f in (Path(data_dir) / name).glob("*.png"))
    mine = files[partition_id::num_partitions]
    images = np.stack([np.asarray(Image.open(f).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE))) for f, _ in mine])
    return images, np.array([label for _, label in mine], dtype=np.int64)


def to_input(images: np.ndarray) -> torch.Tensor:
    pixels = torch.from_numpy(images).float().permute(0, 3, 1, 2) / 255.0
    return (pixels - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def train(model: Net, images: np.ndarray, labels: np.ndarray, epochs: int, batch_size: int, lr: float) -> float:
    """Plain SGD on the client's images; returns the mean training loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    inputs, targets = to_input(images), torch.from_numpy(labels)
    losses = []
    model.train()
    for _ in range(epochs):
        for start in range(0, len(targets), batch_size):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs[start:start + batch_size]),
                                               targets[start:start + batch_size])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return float(np.mean(losses))


def test(model: Net, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(to_input(images))
    return float(nn.functional.cross_entropy(logits, torch.from_numpy(labels))), \
        float((logits.argmax(1).numpy() == labels).mean())
