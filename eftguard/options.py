"""Options declared once, beside their dataclass field: `option(default, help, ...)` holds the help text, the
parser of the flag's text, the choices and the bounds of the value, and every command reads them from there: its
argparse flags and --help (`add_arguments`), the keys and types of a TOML file (`from_mapping`) and the check of
each value (`check_values`). Every flag of every command is declared so (tests/test_options.py walks them): the
training configuration, pretraining, the bench, the demo, the audit, the deployment commands, the attacks
(eftguard.attacks.base, and the options every attack takes, eftguard.audit.api.AttackRunOptions) and the report;
a cross-field rule is the only check written by hand.

A parser turns the text of a flag into its value or raises ValueError("must be ..., got '...'"); a bound checks a
value wherever it came from (a flag, a TOML file, a dataclass built in code) with the same words, so a bad value
is refused identically from the command line and from a file.
"""

from __future__ import annotations

import argparse
import difflib
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Collection

from eftguard.errors import ConfigError

SEED_LIMIT = 2 ** 32 - 1  # the largest --seed of training, pretraining, the bench and the attacks


# --- parsers: the text of a flag -> its value ------------------------------------------------------------

def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in [minimum, maximum]."""
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"must be a whole number {bounds}, got '{text}'")
        return value
    return parse


def finite_number(above: float, at_most: float = math.inf, zero_allowed: bool = False) -> Callable[[str], float]:
    """A finite float in (above, at_most], or [0, at_most] with zero_allowed and above 0; NaN and infinities
    are refused."""
    low = "[0" if zero_allowed and above == 0 else f"({above}"
    bounds = (">= 0" if low == "[0" else f"> {above}") if at_most == math.inf else f"in {low}, {at_most}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (above < value or (low == "[0" and value == 0)) and value <= at_most):
            raise ValueError(f"must be a finite number {bounds}, got '{text}'")
        return value
    return parse


def path_value(text: str) -> Path:
    """A path; an empty one (an unset shell variable) would silently mean the current folder."""
    if not text.strip():
        raise ValueError("must be a path, got an empty string")
    return Path(text)


def name_value(text: str) -> str:
    if not text.strip():
        raise ValueError("must be a name, got an empty string")
    return text


# --- bounds: a rule on a value, wherever it came from ----------------------------------------------------

@dataclass(frozen=True)
class Bound:
    """A rule on an option's value, in the words of its refusal: "--flag must be {says}, got {value}"."""

    holds: Callable[[Any], bool]
    says: str


def above(limit: float) -> Bound:
    return Bound(lambda value: value > limit, f"> {limit:g}")


def at_least(limit: float) -> Bound:
    return Bound(lambda value: value >= limit, f">= {limit:g}")


SEED = Bound(lambda value: 0 <= value <= SEED_LIMIT, f"a whole number in 0..{SEED_LIMIT}")


# --- the declaration ---------------------------------------------------------------------------------------

def option(default: Any, help: str, parse: Callable[[str], Any] | None = None, choices: Collection[str] | None = None,
           *, bound: Bound | None = None, check: Callable[[Any], None] | None = None, noun: str = "value",
           metavar: str | None = None, positional: bool = False, repeated: bool = False, flag: str | None = None) -> Any:
    """A dataclass field that is also a user-facing option (`--name-with-dashes`, the TOML key `name`).

    parse: the flag's text -> value (default: the field's type); choices: its fixed values (a table such as
    PRESETS is read when checked, so an entry added later counts; a value outside them is "unknown {noun}");
    bound: a rule on the value; check: a function that raises its own error for a value no bound describes (a
    dataset name). default MISSING: a required flag (or, with positional, an argument). A tuple field takes
    several values after its flag (`--mask-ratios 0 0.5`), or with repeated one per flag, the flag repeated
    (`--gate A --gate B`: a value after the last could be a positional argument). flag: the flag when it is not the
    field's name (`--round` for round_number, run_attack's keyword); the flag without dashes is then its TOML key."""
    spec = OptionSpec(help, parse, choices, bound, check, noun, metavar, positional, repeated, flag)
    return field(metadata={"option": spec}) if default is MISSING else field(default=default, metadata={"option": spec})


@dataclass(frozen=True)
class OptionSpec:
    help: str
    parse: Callable[[str], Any] | None
    choices: Collection[str] | None
    bound: Bound | None
    check: Callable[[Any], None] | None
    noun: str
    metavar: str | None
    positional: bool
    repeated: bool
    flag: str | None


TYPES = {"str": str, "int": int, "float": float, "bool": bool, "Path": Path}
TOML_TYPE_NAMES = {"str": "a string", "bool": "true or false", "int": "a whole number", "float": "a number"}


@dataclass(frozen=True)
class Option:
    """One user-facing option: name (a Python identifier), its default (None: not set), help text, parser, the
    field's type name ("int", "str", ...) and, for a fixed set of values, the choices."""

    name: str
    default: Any
    help: str
    parse: Callable[[str], Any]
    choices: Collection[str] | None = None
    kind: str = "str"
    bound: Bound | None = None
    check: Callable[[Any], None] | None = None
    noun: str = "value"
    metavar: str | None = None
    required: bool = False
    positional: bool = False
    repeated: bool = False
    own_flag: str | None = None

    @property
    def flag(self) -> str:
        return self.own_flag or "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """Its key in a TOML file: the flag's words joined by _ (round_number's is `round`, as its flag)."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def many(self) -> bool:
        """A tuple field: one or more values (`--mask-ratios 0 0.5`)."""
        return self.kind.startswith("tuple[")

    @property
    def element_kind(self) -> str:
        return self.kind[len("tuple["):].split(",")[0].strip() if self.many else self.kind

    def value(self, given: Any, error: type[Exception] = ConfigError, name: str | None = None) -> Any:
        """A value given in code (run_attack's keyword arguments) or a file, checked as the CLI checks its text;
        the error names the option (name: as the caller wrote it, default the field's name)."""
        name = name or self.name
        if given is None and self.default is None:
            return None
        if self.kind == "bool":  # bool("no") is True: a switch takes true or false only
            if not isinstance(given, bool):
                raise error(f"{name} must be true or false, got {given!r}")
            return given
        if self.choices is not None and given not in self.choices:
            raise error(f"{name} must be one of {', '.join(self.choices)}, got {given!r}")
        try:
            return self.parse(str(given))
        except ValueError as exc:
            raise error(f"{name} {exc}") from None

    def checked(self, value: Any) -> None:
        """A ConfigError naming the flag when value breaks a rule of the declaration: its own check, then NaN and
        infinities before any bound, since every comparison is False for NaN (`nan > 0` once skipped DP-SGD while
        the server calibrated noise for it), then the choices and the bound."""
        if value is None and (self.default is None or self.required):
            return
        if self.check is not None:  # first: its own words, NaN included (a tuple's "--mask-ratios: nan is not in ...")
            self.check(value)
        for item in value if self.many else (value,):
            if self.element_kind in ("int", "float") and not math.isfinite(item):
                raise ConfigError(f"{self.flag} must be a finite number, got {item}")
            if self.choices is not None and item not in self.choices and not (item == "" == self.default):
                raise ConfigError(f"{self.flag}: unknown {self.noun} '{item}', choose {', '.join(self.choices)}")
            if self.bound is not None and not self.bound.holds(item):
                raise ConfigError(f"{self.flag} must be {self.bound.says}, got {item}")


def options_of(cls: type) -> tuple[Option, ...]:
    """The options a dataclass declares with `option(...)`, in field order."""
    found = []
    for f in fields(cls):
        if "option" not in f.metadata:
            continue
        spec: OptionSpec = f.metadata["option"]
        kind = (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")).removesuffix(" | None")
        element = kind[len("tuple["):].split(",")[0].strip() if kind.startswith("tuple[") else kind
        parse = spec.parse or TYPES.get(element, str)
        found.append(Option(f.name, None if f.default is MISSING else f.default, spec.help, parse, spec.choices, kind,
                            spec.bound, spec.check, spec.noun, spec.metavar, f.default is MISSING, spec.positional,
                            spec.repeated, spec.flag))
    return tuple(found)


def check_values(instance: Any) -> None:
    """Every declared option of a dataclass instance checked against its declaration (the first bad one is a
    ConfigError naming its flag); cross-field rules are the caller's."""
    for opt in options_of(type(instance)):
        opt.checked(getattr(instance, opt.name))


# --- argparse ------------------------------------------------------------------------------------------------

def cli_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from an option parser: its "must be ..." message becomes argparse's."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid int value" names the type
    return convert


def escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def add_argument(parser, opt: Option, help: str | None = None, default: Any = None,
                 show_default: bool = True) -> None:
    """opt's flag on parser. default None (the flag absent unless given: the declaration's default or a file's
    value applies) or argparse.SUPPRESS (absent from the namespace); help defaults to the declaration's, followed
    by its default."""
    text = opt.help if help is None else help
    if opt.kind == "bool" and default is False:  # a switch of a command no file configures: `--force`
        parser.add_argument(opt.flag, dest=opt.name, action="store_true", help=escaped(text))
        return
    if show_default and opt.default not in (None, ()):
        shown = " ".join(map(str, opt.default)) if opt.many else repr(opt.default)
        text = f"{text} (default: {shown})"
    if opt.kind == "bool":  # --name and --no-name: a flag overrides a file's value either way
        parser.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction, default=default,
                            help=escaped(text))
        return
    metavar = opt.metavar or (None if opt.choices else opt.name.upper())
    kwargs = {"type": opt.parse if opt.parse in TYPES.values() else cli_type(opt.parse), "choices": opt.choices,
              "metavar": metavar, "help": escaped(text)}
    if opt.many:  # the declaration's default applies when the flag is absent
        kwargs.update(action="append") if opt.repeated else kwargs.update(nargs="+", action="extend")
        default = None
    if opt.positional:
        parser.add_argument(opt.name, **kwargs)
    else:
        parser.add_argument(opt.flag, dest=opt.name, default=default, required=opt.required, **kwargs)


def add_arguments(parser, cls: type, defaults: bool = False) -> None:
    """The flags of every option cls declares, with their help and defaults: absent flags are None (a TOML file's
    value or the declaration's default applies later), or with defaults, the declaration's default."""
    for opt in options_of(cls):
        add_argument(parser, opt, default=opt.default if defaults else None)


def add_renamed(parser, old: str, new: str) -> None:
    """A flag that was renamed, refused in one line naming the new one; absent, argparse would read it as an
    abbreviation of the new one, and two spellings would live on."""
    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{old} is now {new}: give {new}" + (f" {values}" if values else ""))
    parser.add_argument(old, nargs="?", action=Renamed, help=argparse.SUPPRESS)


def given_values(args: argparse.Namespace, cls: type) -> dict:
    """The options of cls given on the command line (flags added with default None)."""
    return {o.name: getattr(args, o.name) for o in options_of(cls) if getattr(args, o.name, None) is not None}


# --- TOML ----------------------------------------------------------------------------------------------------

def from_mapping(cls: type, values: dict, source: str) -> dict:
    """The keyword arguments of cls from a mapping (a TOML table): keys may use - or _; an unknown key or a
    value of the wrong type is a ConfigError naming the key and what it accepts."""
    known = {o.key: o for o in options_of(cls)}
    kwargs = {}
    for key, value in values.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{source}: unknown option '{key}'; {hint}known: {', '.join(known)}")
        kwargs[known[name].name] = _typed(value, known[name].kind, f"{source}: {key}")
    return kwargs


def _typed(value, kind: str, where: str):
    expected = {"str": str, "bool": bool, "int": int, "float": (int, float)}[kind]
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, expected):
        raise ConfigError(f"{where} must be {TOML_TYPE_NAMES[kind]}, got {value!r}")
    return float(value) if kind == "float" else value
