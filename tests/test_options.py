"""Options are declared once, beside their field (eftguard.options): the flags and --help, the TOML keys and the
check of every value come from the declaration, so a bad value is refused with the same line from the command line,
from a TOML file and from code, and a new field without a declaration fails here."""

import dataclasses
import math
import re

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from eftguard.cli import build_parser, main
from eftguard.config import TrainConfig
from eftguard.errors import ConfigError
from eftguard.options import options_of
from eftguard.pretrain import PretrainConfig


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("cls", [TrainConfig, PretrainConfig])
def test_every_field_is_a_declared_option_with_help(cls):
    declared = {o.name: o for o in options_of(cls)}
    assert set(declared) == {f.name for f in dataclasses.fields(cls)}, "declare the new field with option(...)"
    for option in declared.values():
        assert len(option.help.split()) >= 2, f"{option.name}: say what it does in its help"
        assert option.default == getattr(cls(), option.name)


def test_train_help_shows_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in options_of(TrainConfig):
        assert option.flag in text
        assert " ".join(option.help.split()[:4]) in text, option.name
    assert "(default: 'eftvit')" in text and "(default: 0.75)" in text and "--no-record-truth" in text


def test_the_flags_are_the_declarations():
    """argparse's type and choices are the declaration's: a value argparse accepts is one the config can hold."""
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    actions = {a.dest: a for a in train._actions}
    for option in options_of(TrainConfig):
        action = actions[option.name]
        assert action.default is None  # absent unless given: a --config file's value then applies
        if option.choices is not None:
            assert set(action.choices) == set(option.choices)


@pytest.mark.parametrize("flag, key, value, message", [
    ("--clients", "clients", "0", "--clients must be > 0, got 0"),
    ("--mask-ratio", "mask_ratio", "1.5", "--mask-ratio must be in [0, 1) (fraction of patches dropped), got 1.5"),
    ("--seed", "seed", "-3", "--seed must be a whole number in 0..4294967295, got -3"),
    ("--dp-eps", "dp_eps", "101", "--dp-eps must be in [0, 100] (0: no DP-SGD"),
    ("--weight-decay", "weight_decay", "-0.5", "--weight-decay must be >= 0, got -0.5"),
    ("--head-sparsity", "head_sparsity", "1.0", "--head-sparsity must be in [0, 1)"),
])
def test_a_bad_value_is_refused_identically_from_the_cli_and_from_toml(capsys, tmp_path, flag, key, value, message):
    code, from_flag = run_cli(capsys, "train", "--out", str(tmp_path / "a"), flag, value)
    (tmp_path / "c.toml").write_text(f"{key} = {value}\n")
    code_toml, from_file = run_cli(capsys, "train", "--out", str(tmp_path / "b"), "--config", str(tmp_path / "c.toml"))
    assert code == code_toml == 2
    assert from_flag == from_file and from_flag.startswith("eftguard: error: ") and from_flag.count("\n") == 1
    assert message in from_flag
    with pytest.raises(ConfigError) as in_code:  # and from code, with the same words
        TrainConfig(**{key: type(getattr(TrainConfig(), key))(value)}).resolved()
    assert f"eftguard: error: {in_code.value}\n" == from_flag


@pytest.mark.parametrize("text, message", [
    ("mask_ration = 0.5", "c.toml: unknown option 'mask_ration'; did you mean 'mask_ratio'?"),
    ('rounds = "five"', "c.toml: rounds must be a whole number, got 'five'"),
    ("rounds = 2.5", "c.toml: rounds must be a whole number, got 2.5"),
    ("mask-ratio = true", "c.toml: mask-ratio must be a number, got True"),
    ("pretrained = 1", "c.toml: pretrained must be true or false, got 1"),
    ("method = 3", "c.toml: method must be a string, got 3"),
])
def test_toml_keys_and_types_come_from_the_declarations(capsys, tmp_path, text, message):
    (tmp_path / "c.toml").write_text(text + "\n")
    code, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"), "--config", str(tmp_path / "c.toml"))
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


HOSTILE_NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 70, 2 ** 70),
                            st.sampled_from([0, -1, -0.0, 1e-320, 1e308, -1e308, 2 ** 32, 2 ** 63]))
# the documented range of each (docs/training.md, --help), written here apart from the declarations they check
BOUNDED = {"clients": (int, lambda v: v > 0), "rounds": (int, lambda v: v > 0), "batch_size": (int, lambda v: v > 0),
           "seed": (int, lambda v: 0 <= v <= 2 ** 32 - 1), "mask_ratio": (float, lambda v: 0 <= v < 1),
           "dp_eps": (float, lambda v: 0 <= v <= 100), "dp_delta": (float, lambda v: 0 <= v < 1),
           "head_sparsity": (float, lambda v: 0 <= v < 1), "server_lr": (float, lambda v: v > 0),
           "round_timeout": (float, lambda v: v > 0)}


def _accepted(name: str, value) -> bool:
    try:
        TrainConfig(**{name: value}).resolved()
    except ConfigError as exc:
        assert "\n" not in str(exc) and f"--{name.replace('_', '-')}" in str(exc)
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(BOUNDED)), value=HOSTILE_NUMBERS)
@example(name="dp_eps", value=100.5)
@example(name="mask_ratio", value=1.0)
@example(name="head_sparsity", value=1.0)
@example(name="dp_delta", value=1.0)
@example(name="seed", value=2 ** 32)
@example(name="clients", value=0)
def test_hostile_numbers_are_refused_in_one_line_naming_the_option(name, value):
    """Whatever number reaches a bounded option, a finite value in its documented range is accepted and anything
    else is one ConfigError line naming the flag: never a config that trains with NaN, an infinity or an
    out-of-range value."""
    kind, in_range = BOUNDED[name]
    if kind is int and isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            return  # TOML and argparse refuse a fractional whole number before the config exists
        value = int(value)
    value = kind(value)
    assert _accepted(name, value) == (math.isfinite(value) and in_range(value)), value


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["--dp-eps", "--mask-ratio", "--head-sparsity", "--dp-delta", "--seed"]),
       text=st.sampled_from(["nan", "inf", "-inf", "-1", "1e400", "-1e-300", str(2 ** 64)]))
def test_hostile_flags_end_in_one_line_and_exit_2(capsys, tmp_path_factory, name, text):
    """Each value is out of its option's bounds: refused before any run folder exists."""
    out = tmp_path_factory.mktemp("run") / "run"
    code, err = run_cli(capsys, "train", "--out", str(out), f"{name}={text}")
    if code == 2 and "invalid int value" in err:  # argparse's own refusal of a fractional whole number
        assert name in err.strip().splitlines()[-1]
    else:
        assert code == 2 and err.startswith("eftguard: error: ") and err.count("\n") == 1 and name in err, err
    assert not out.exists()


def _subcommand(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("command, cls", [
    ("bench", "eftguard.bench_config.BenchConfig"),
    ("certs", "eftguard.federation.deployment.CertsOptions"),
    ("superlink", "eftguard.federation.deployment.SuperLinkOptions"),
    ("node-key", "eftguard.federation.deployment.NodeKeyOptions"),
    ("register-node", "eftguard.federation.deployment.RegisterNodeOptions"),
    ("supernode", "eftguard.federation.deployment.SuperNodeOptions"),
    ("demo", "eftguard.cli.DemoOptions"),
    ("audit", "eftguard.cli.AuditOptions"),
    ("train", "eftguard.cli.TrainCommandOptions"),
    ("train", "eftguard.federation.deployment.TrainDeploymentOptions"),
    ("pretrain", "eftguard.cli.PretrainCommandOptions"),
    ("bench", "eftguard.cli.BenchCommandOptions"),
    ("report", "eftguard.attack_cli.ReportOptions"),
])
def test_the_bench_demo_audit_and_deployment_commands_are_generated_from_their_declarations(command, cls):
    import importlib

    module, name = cls.rsplit(".", 1)
    declared = options_of(getattr(importlib.import_module(module), name))
    actions = {a.dest: a for a in _subcommand(command)._actions}
    for option in declared:
        assert option.help in actions[option.name].help.replace("%%", "%"), option.name
        assert actions[option.name].required == option.required


def test_a_list_option_takes_several_values_after_one_flag_or_repeated_flags():
    parser = build_parser()
    assert parser.parse_args(["certs", "--out", "c", "--san", "a", "--san", "b"]).san == ["a", "b"]
    assert parser.parse_args(["certs", "--out", "c"]).san is None  # the declaration's default applies
    gated = parser.parse_args(["audit", "--gate", "labels.l1 > 0.3", "a.toml"])  # a repeated option takes one value
    assert gated.gate == ["labels.l1 > 0.3"] and str(gated.audit_file) == "a.toml"
    assert parser.parse_args(["bench", "--mask-ratios", "0", "0.5"]).mask_ratios == [0.0, 0.5]


def _declared_options():
    """Every option any command declares: the dataclasses of eftguard.options, and the attack families' and
    methods' own."""
    import eftguard.attack_cli as attack_cli
    import eftguard.bench_config as bench_config
    import eftguard.cli as cli
    import eftguard.federation.deployment as deployment
    from eftguard.audit.api import AttackRunOptions
    from eftguard.audit.families import FAMILIES

    classes = [TrainConfig, PretrainConfig, bench_config.BenchConfig, AttackRunOptions]
    for module in (cli, attack_cli, deployment):
        classes += [c for c in vars(module).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
                    and c.__name__.endswith("Options")]
    found = [o for cls in classes for o in options_of(cls)]
    for family in FAMILIES.values():
        found += [*family.options, *(o for cls in family.registry.classes.values() for o in options_of(cls))]
    return found


def _commands(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))
    if prefix:
        yield " ".join(prefix), parser


def test_no_command_has_a_hand_written_flag():
    """Every flag and argument of every command is an option() declaration (its flag, destination and help): none
    is written by hand beside one, so its --help, its TOML key and its check cannot drift apart."""
    import argparse

    declared = _declared_options()
    by_flag = {(o.flag, o.name) for o in declared if not o.positional}
    positional = {o.name for o in declared if o.positional}
    checked = 0
    for command, parser in _commands(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue
            if action.option_strings:
                assert (action.option_strings[0], action.dest) in by_flag, f"eftguard {command} {action.option_strings}"
            else:
                assert action.dest in positional, f"eftguard {command} {action.dest}"
            assert len(action.help.split()) >= 2, f"eftguard {command} {action.dest}: say what it does"
            checked += 1
    assert checked > 150  # every command was walked


def test_an_audit_file_reads_the_common_attack_options_from_their_declaration():
    """An [[attack]] table's round, clients, seed, lpips_backend and power_check are checked before any training by
    the declaration the attack commands' flags come from (eftguard.audit.api.AttackRunOptions)."""
    from eftguard.audit.grid import check_attack_options

    where = "a.toml [[attack]] #1"
    check_attack_options("labels", "head", {"round_number": 2, "clients": "0,1", "seed": 3}, where)
    for options, message in [({"round_number": 0}, "round must be a whole number >= 1, got '0'"),
                             ({"clients": "0;1"}, "clients must be 'all' or comma-separated partition ids, got '0;1'"),
                             ({"seed": -1}, "seed must be a whole number in 0..4294967295"),
                             ({"power_check": "yes"}, "power_check must be true or false, got 'yes'")]:
        with pytest.raises(ConfigError, match="^" + re.escape(f"{where}: {message}")):
            check_attack_options("labels", "head", options, where)


def test_a_weight_that_may_be_zero_is_refused_below_zero_with_its_real_bound():
    """--tv and the like: 0 switches the term off and is accepted; a negative or NaN weight is one message that
    names the bound a user can type (">= 0", not an epsilon below zero)."""
    from eftguard.options import finite_number

    parse = finite_number(0, zero_allowed=True)
    assert parse("0") == 0.0 and parse("0.3") == 0.3
    for text in ("-1", "-1e-13", "nan", "inf"):
        with pytest.raises(ValueError, match=r"must be a finite number >= 0, got"):
            parse(text)
    with pytest.raises(ValueError, match=r"> 0, got '0'"):
        finite_number(0)("0")
