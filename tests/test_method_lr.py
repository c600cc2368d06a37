"""The client learning rate where --lr is not given is the method's own (MethodSpec.default_lr): the PEFT methods
barely move from a pretrained checkpoint at full fine-tuning's rate. --lr, a config file's lr and an audit's lr
still win."""

import dataclasses

import pytest

from eftguard.audit.grid import parse_audit
from eftguard.cli import build_parser, config_from_args
from eftguard.config import TrainConfig
from eftguard.errors import ConfigError
from eftguard.federation.records import ClientSettings
from eftguard.methods import METHODS


@pytest.fixture
def marked_defaults(monkeypatch):
    """Every method's default lr made distinct (and unlike any literal in the code), so that a method reading
    another's default, or one global default, fails."""
    marks = {name: 0.0101 * (index + 1) for index, name in enumerate(METHODS)}
    for name, lr in marks.items():
        monkeypatch.setitem(METHODS, name, dataclasses.replace(METHODS[name], default_lr=lr))
    return marks


def train_config(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_without_lr_each_method_trains_at_its_own_default(marked_defaults):
    for name, lr in marked_defaults.items():
        assert train_config("--method", name).lr == lr
        assert ClientSettings.from_config(TrainConfig(method=name), 1).lr == lr  # what the clients are sent


def test_lr_on_the_command_line_or_in_a_config_file_wins(marked_defaults, tmp_path):
    assert train_config("--method", "fed-lora", "--lr", "0.0007").lr == 0.0007
    config = tmp_path / "c.toml"
    config.write_text('method = "fed-head"\nlr = 0.0003\n')
    assert train_config("--config", str(config)).lr == 0.0003
    assert train_config("--config", str(config), "--lr", "0.0005").lr == 0.0005
    config.write_text('method = "fed-head"\n')
    assert train_config("--config", str(config)).lr == marked_defaults["fed-head"]
    assert train_config("--config", str(config), "--method", "fed-bias").lr == marked_defaults["fed-bias"]


def test_an_audit_grid_over_methods_gives_each_its_default_unless_train_sets_lr(marked_defaults):
    grid = {"method": ["eftvit", "fed-head", "headprune-lora"]}
    audit = parse_audit({"train": {"rounds": 1}, "grid": grid}, "a.toml")
    assert {c.varied["method"]: c.config.lr for c in audit.configurations} == \
        {name: marked_defaults[name] for name in grid["method"]}
    fixed = parse_audit({"train": {"rounds": 1, "lr": 0.002}, "grid": grid}, "a.toml")
    assert {c.config.lr for c in fixed.configurations} == {0.002}


def test_help_names_the_default_of_every_method(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no method name broken at its hyphen
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    for name, spec in METHODS.items():
        assert f"{name} {spec.default_lr:g}" in help_text


def test_a_negative_lr_is_still_refused():
    with pytest.raises(ConfigError, match="--lr must be > 0"):
        train_config("--lr", "-0.001")
