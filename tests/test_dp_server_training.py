"""Server training under --dp-eps (issue 11): the feature rows are released with noise far above their signal, so
the server keeps theta's update on them only if its own public images do not say it hurt (training that cannot
hurt); without --dp-eps the server trains exactly as before."""

import torch
from torch import nn

from eftguard.training import TrainResult, keep_if_not_worse


def clusters(generator: torch.Generator, n: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """Three well separated Gaussian clusters in 8 dimensions: a task a linear classifier solves."""
    labels = torch.arange(n) % 3
    centres = torch.eye(8)[:3] * 6
    return centres[labels] + torch.randn(n, 8, generator=generator), labels


def fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int) -> TrainResult:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return TrainResult(float(loss.detach()), steps)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_an_update_on_pure_noise_rows_that_lowers_public_accuracy_is_undone_exactly():
    """The DP accident: rows that are almost all noise, with labels at random, pull a good classifier off its task;
    the guard sees the public accuracy fall and restores every parameter bit for bit."""
    generator = torch.Generator().manual_seed(0)
    public_x, public_y = clusters(generator)
    model = nn.Linear(8, 3)
    fit(model, *clusters(generator), lr=0.1, steps=100)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = accuracy(model, public_x, public_y)
    noise_rows = torch.randn(300, 8, generator=generator) * 200
    noise_labels = torch.randint(0, 3, (300,), generator=generator)

    def train_on_noise() -> TrainResult:
        result = fit(model, noise_rows, noise_labels, lr=1.0, steps=20)
        assert accuracy(model, public_x, public_y) < good - 0.2  # the update really hurt
        return result

    result, kept = keep_if_not_worse(model, train_on_noise, lambda: accuracy(model, public_x, public_y))
    assert not kept and result.steps == 20
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert accuracy(model, public_x, public_y) == good


def test_an_update_that_does_not_lower_public_accuracy_is_kept():
    generator = torch.Generator().manual_seed(1)
    public_x, public_y = clusters(generator)
    model = nn.Linear(8, 3)
    start = accuracy(model, public_x, public_y)
    _, kept = keep_if_not_worse(model, lambda: fit(model, *clusters(generator), lr=0.1, steps=50),
                                lambda: accuracy(model, public_x, public_y))
    assert kept and accuracy(model, public_x, public_y) > start + 0.3


def global_module_changed(run, round_number: int) -> bool:
    before, after = run.load_checkpoint(round_number - 1), run.load_checkpoint(round_number)
    return any(not torch.equal(before[k], after[k]) for k in before if k.startswith("global_module."))


def test_dp_rounds_keep_theta_only_where_the_guard_says_so_and_runs_without_dp_always_train(tmp_path, micro_preset):
    """Through the real server and clients (in-process grid): under --dp-eps every round records whether theta's
    update was kept, and theta (which only the server trains) changed in exactly the rounds that say so; without
    --dp-eps the key is null and theta is trained every round, as before."""
    from conftest import train_in_process
    from eftguard.rundir import RunDirectory

    # batch size >= every client's images: sample rate 1, whose accounting is closed-form (fast to calibrate)
    common = dict(model=micro_preset, train_samples=64, batch_size=64, server_lr=0.05)
    dp = RunDirectory.open(train_in_process(tmp_path / "dp", rounds=2, dp_eps=8.0, accountant="rdp", **common))
    for metrics in dp.metrics():
        assert isinstance(metrics["server_update_kept"], bool)
        assert global_module_changed(dp, metrics["round"]) == metrics["server_update_kept"]
    plain = RunDirectory.open(train_in_process(tmp_path / "plain", **common))
    for metrics in plain.metrics():
        assert metrics["server_update_kept"] is None and global_module_changed(plain, metrics["round"])


def test_an_update_that_leaves_public_accuracy_unchanged_is_kept():
    """A tie keeps the update: the guard undoes only harm it sees."""
    model = nn.Linear(8, 3)
    _, kept = keep_if_not_worse(model, lambda: fit(model, torch.ones(4, 8), torch.zeros(4, dtype=torch.long),
                                                   lr=0.1, steps=1), lambda: 0.5)
    assert kept


def test_the_guard_images_are_a_seeded_subset_of_the_public_split(micro_preset):
    """The same images for the same run seed (a resumed run judges its updates as the uninterrupted one did), other
    images for another seed, never more than GUARD_IMAGES, and only from the public split."""
    import numpy as np

    from eftguard.data.plan import run_dataset
    from eftguard.federation.server import GUARD_IMAGES, guard_images

    dataset = run_dataset("photos", "", micro_preset, 64, 16, 0)
    images, labels = guard_images(dataset, seed=3)
    again, _ = guard_images(dataset, seed=3)
    other, _ = guard_images(dataset, seed=4)
    assert len(images) == min(GUARD_IMAGES, len(dataset.public)) and torch.equal(images, again)
    assert not torch.equal(images, other)
    public = torch.from_numpy(dataset.public.images)
    rows = [int(torch.nonzero((public == image).flatten(1).all(1))[0]) for image in images]
    assert np.array_equal(labels.numpy(), dataset.public.labels[rows])
