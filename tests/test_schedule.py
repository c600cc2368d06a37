"""Warm-up and learning-rate schedule of federated training: the server sends each round's client learning rate and
trains theta at the round's server learning rate, with the pretrain command's schedule taken per round."""

import pytest

from eftguard.cli import main
from eftguard.federation import apps, server
from eftguard.schedule import lr_factor
from conftest import MICRO_PRESET, train_in_process

pytestmark = pytest.mark.usefixtures("micro_preset")


def test_warmup_is_linear_then_constant_or_cosine_toward_one_percent():
    assert [lr_factor(step, 2, 5, "constant") for step in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    cosine = [lr_factor(step, 2, 5, "cosine") for step in range(5)]
    assert cosine == pytest.approx([0.5, 1.0, 1.0, 0.01 + 0.99 * 0.75, 0.01 + 0.99 * 0.25])  # cos(pi/3), cos(2pi/3)
    assert lr_factor(9, 0, 10, "cosine") > lr_factor(10, 0, 10, "cosine") == pytest.approx(0.01)


def test_each_round_trains_clients_and_server_at_the_scheduled_rates(tmp_path, monkeypatch):
    """Four rounds, two of warm-up, then cosine: factors 0.5, 1, 1, 0.505 of --lr (sent to every client) and of
    --server-lr (theta's training)."""
    client_rates, server_rates = [], []

    def client_round(settings, *args, **kwargs):
        client_rates.append((settings.round, settings.lr))
        return original_client(settings, *args, **kwargs)

    def train_global(model, features, labels, optim, *args, **kwargs):
        server_rates.append(optim.lr)
        return original_server(model, features, labels, optim, *args, **kwargs)

    original_client, original_server = apps.client_round, server.train_global
    monkeypatch.setattr(apps, "client_round", client_round)
    monkeypatch.setattr(server, "train_global", train_global)
    train_in_process(tmp_path / "run", model=MICRO_PRESET, rounds=4, train_samples=32, test_samples=8, batch_size=16,
                     lr=2e-3, server_lr=4e-3, warmup_rounds=2, lr_schedule="cosine")
    factors = [0.5, 1.0, 1.0, 0.01 + 0.99 * 0.5]
    assert client_rates == [(r, pytest.approx(2e-3 * f)) for r, f in enumerate(factors, 1) for _ in range(2)]
    assert server_rates == pytest.approx([4e-3 * f for f in factors])


def test_a_warmup_as_long_as_the_run_is_refused_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "run"), "--rounds", "3", "--warmup-rounds", "3"])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "eftguard: error: --warmup-rounds must be in [0, --rounds) = [0, 3), got 3")
