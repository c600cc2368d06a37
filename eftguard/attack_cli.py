"""`eftguard attack invert|labels|gradient` and `eftguard report`: a thin layer over eftguard.audit.

Each attack command is derived from its family (eftguard.audit.families) and the family's registry of methods:
--method's choices, the per-method flags and their --help come from the attack classes, so a new method shows
up here without touching this file. The command parses, calls `run_attack` once per method and prints the
summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import MISSING
from pathlib import Path

from rich.console import Console
from rich.table import Table

from eftguard.app_attacks import app_methods, run_app_attack
from eftguard.app_audit import attack_membership, public_option, write_app_audit_report
from eftguard.apprun import is_app_run
from eftguard.attack_report import AttackReport
from eftguard.attacks.base import AttackError, reads_a_tampered_round
from eftguard.audit.api import AttackRunOptions, open_run, out_root, run_attack, stage_progress
from eftguard.audit.families import FAMILIES
from eftguard.device import DeviceOptions
from eftguard.options import Option, add_argument, add_arguments, add_renamed, escaped, option, options_of, path_value
from eftguard.paths import output_file_problem, read_text_file
from eftguard.report import summary_table, write_audit_report, write_run_report
from eftguard.rundir import RunError

console = Console(stderr=True)


# --- shared -----------------------------------------------------------------------------------------------

class OneLineErrorParser(argparse.ArgumentParser):
    """Attack subcommands answer a bad option like every other bad input: one `eftguard: error:` line."""

    def error(self, message: str):
        self.exit(2, f"eftguard: error: {message} (see {self.prog} --help)\n")


KEY_HELP = "at-rest key of a run trained with --encrypt-at-rest (needed to read its uploads)"


# --- eftguard report --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """eftguard report (declared once: eftguard.options)."""

    run: Path = option(MISSING, "run directory, or an audit's folder", path_value, metavar="RUN", positional=True)
    reports: Path | None = option(None, "folder of attack reports, where the run report is written too (default: "
                                        "RUN/reports)", path_value)
    key: Path | None = option(None, KEY_HELP, path_value, metavar="KEYFILE")


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="gather a run's attack reports into report.html and report.md",
                            description="Writes report.html (self-contained, images inlined), report.md and "
                                        "report.json with the run's configuration, accuracy per round and every "
                                        "attack report found under --reports. Given an audit's folder (eftguard "
                                        "audit --out, or the demo's), writes its report.html and report.md again "
                                        "from its summary.json, training and attacking nothing.")
    add_arguments(report, ReportOptions)


def cmd_report(args: argparse.Namespace) -> None:
    if is_audit_folder(args.run):
        rewrite_audit_report(args)
        return
    run = open_run(args.run, args.key)
    reports_dir = out_root(run, args.reports, "--reports")
    if args.reports is None and not any(reports_dir.glob("*/report.json")):
        elsewhere = audit_reports_of(run.path)
        if elsewhere is not None:
            console.print(f"{run.path} was attacked by the audit in {elsewhere.parent.parent}, which keeps its attack "
                          f"reports in {elsewhere}: eftguard report {run.path} --reports {elsewhere} gathers them",
                          soft_wrap=True)  # a command to copy: not broken inside a path
    files = write_run_report(run.path, (run.path / "config.toml").read_text(), run.metrics(), reports_dir)
    for file in files:
        console.print(f"wrote {file}")


def audit_reports_of(run_path: Path) -> Path | None:
    """Where an audit (or the demo) wrote a run's attack reports, AUDIT/reports/<configuration>, when the run is one
    of an audit's (AUDIT/runs/NAME and listed in AUDIT/summary.json); None otherwise."""
    run_path = run_path.resolve()
    audit = run_path.parent.parent
    if run_path.parent.name != "runs" or not is_audit_folder(audit):
        return None
    try:
        configurations = json.loads(read_text_file(audit / "summary.json")).get("configurations")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    for configuration in configurations if isinstance(configurations, list) else []:
        if not isinstance(configuration, dict) or configuration.get("run") != f"runs/{run_path.name}":
            continue
        attacks = configuration.get("attacks")
        for entry in attacks.values() if isinstance(attacks, dict) else []:
            report = entry.get("report") if isinstance(entry, dict) else None
            if isinstance(report, str) and (audit / report).is_file():
                return (audit / report).parent.parent
    return None


def is_audit_folder(path: Path) -> bool:
    return path.is_dir() and (path / "summary.json").is_file() and not (path / "manifest.json").exists()


def rewrite_audit_report(args: argparse.Namespace) -> None:
    """An audit's report.html and report.md written again from its summary.json, with this eftguard's report code
    (e.g. after an upgrade), without training or attacking anything."""
    if args.reports is not None or args.key is not None:
        raise RunError(f"{args.run} is an audit's folder: --reports and --key are for a run; the audit report is "
                       "written beside its summary.json")
    try:
        summary = json.loads(read_text_file(args.run / "summary.json"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{args.run / 'summary.json'} cannot be read ({exc}): run the audit again with the same --out "
                       "to write it again (finished runs and attacks are reused)") from None
    for name in ("report.html", "report.md"):
        problem = output_file_problem(args.run / name, "the audit report")
        if problem:
            raise RunError(f"{args.run / name} {problem}")
    write = write_app_audit_report if "channels" in summary else write_audit_report  # a recorded Flower app's audit
    for file in write(summary, args.run):
        print(f"wrote {file}", file=sys.stderr)


# --- eftguard attack ... ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AttackCommandOptions:
    """The flags of every attack command beside run_attack's common options (AttackRunOptions) and the family's
    and methods' own (declared once: eftguard.options); --method's choices and default are the family's."""

    run: Path = option(MISSING, "run directory to attack", path_value, metavar="RUN", positional=True)
    method: str | None = option(None, "the attack's method, or all (one report per method)")
    out: Path | None = option(None, "folder for reports: <out>/<attack>/report.json, report.md, grid.png (default: "
                                    "RUN/reports)", path_value)
    key: Path | None = option(None, KEY_HELP, path_value, metavar="KEYFILE")
    public: Path | None = public_option()  # membership on a recorded Flower app


def add_attack_parser(sub: argparse._SubParsersAction) -> None:
    attack = sub.add_parser("attack", help="attack a run's observed uploads and score what leaks",
                            description="Attacks read only what the server observed (observed/, the round's "
                                        "weights, public data); the auditor then scores them against truth/.")
    kinds = attack.add_subparsers(dest="attack", required=True, parser_class=OneLineErrorParser)
    for family in FAMILIES.values():
        add_family_parser(kinds, family)


def add_option(parser: argparse.ArgumentParser, option: Option, help: str) -> None:
    """A flag that is absent from the parsed arguments unless given: run_attack fills in the defaults."""
    add_argument(parser, option, help=help, default=argparse.SUPPRESS, show_default=False)


def method_options(family) -> dict[str, list[tuple[str, Option]]]:
    """Option name -> (method, option) for every method of the family that declares it."""
    by_name: dict[str, list[tuple[str, Option]]] = {}
    for method, cls in family.registry.classes.items():
        for option in options_of(cls):
            by_name.setdefault(option.name, []).append((method, option))
    return by_name


def method_option_help(entries: list[tuple[str, Option]]) -> str:
    """One help text for an option several methods declare, e.g. "decoder: ... (default: 1000); optimize: ..."."""
    if len({o.help for _, o in entries}) == 1 and len({repr(o.default) for _, o in entries}) == 1:
        return f"{', '.join(m for m, _ in entries)}: {entries[0][1].help} (default: {entries[0][1].default})"
    return "; ".join(f"{m}: {o.help} (default: {o.default})" for m, o in entries)


def add_family_parser(kinds: argparse._SubParsersAction, family) -> argparse.ArgumentParser:
    methods = family.registry.classes
    listing = " ".join(f"{name}: {cls.summary}." for name, cls in methods.items())
    parser = kinds.add_parser(family.name, help=family.help,
                              description=escaped(f"{family.description} Methods: {listing} Reports go to "
                                                  f"OUT/{family.name}-METHOD/."))
    parser.set_defaults(family=family.name)
    command = {o.name: o for o in options_of(AttackCommandOptions)}
    add_argument(parser, command["run"])
    app_default = "; on a recorded Flower app: all, of lira | rmia" if family.name == "membership" else ""
    add_argument(parser, dataclasses.replace(command["method"], choices=(*methods, "all")),
                 help=f"{' | '.join(methods)} | all (one report per method{named_only(family.registry)}; default: "
                      f"{family.cli_method}{app_default})")
    for option in family.options:
        add_option(parser, option, option.help + (f" (default: {option.default})" if option.default is not None else ""))
    for entries in method_options(family).values():
        add_option(parser, entries[0][1], method_option_help(entries))
    for option in common_options_of(family):
        add_argument(parser, option, default=option.default)
    if family.name == "membership":
        add_argument(parser, command["public"])
    add_argument(parser, command["out"])
    add_argument(parser, command["key"])
    add_arguments(parser, DeviceOptions, defaults=True)
    add_renamed(parser, "--client", "--clients")
    return parser


def common_options_of(family) -> list[Option]:
    """run_attack's common options that the family's attacks use: --seed where they draw, --lpips-backend where
    they are scored on images."""
    used = {"seed": family.seeded, "lpips_backend": family.image_metrics}
    return [o for o in options_of(AttackRunOptions) if used.get(o.name, True)]


def options_per_method(args: argparse.Namespace, family, methods: tuple[str, ...]) -> dict[str, dict]:
    """The options given on the command line, each passed to the methods that take it; one that none of the
    chosen methods takes is an error naming the methods that do."""
    own = [o.name for o in family.options]
    declared = method_options(family)
    given = {name: getattr(args, name) for name in [*own, *declared] if hasattr(args, name)}
    per_method = {}
    for method in methods:
        takes = set(own) | {o.name for o in options_of(family.registry.classes[method])}
        per_method[method] = {k: v for k, v in given.items() if k in takes}
    for name in set(given) - {k for options in per_method.values() for k in options}:
        users = ", ".join(m for m, _ in declared[name])
        raise AttackError(f"--{name.replace('_', '-')} does not apply to --method {args.method}: it is an option "
                          f"of --method {users}")
    return per_method


def cmd_attack(args: argparse.Namespace) -> None:
    family = FAMILIES[args.family]
    run = args.run
    if is_app_run(run):
        attack_recorded_app(args, family)
        return
    if getattr(args, "public", None) is not None:
        raise AttackError("--public gives a recorded Flower app's membership attacks their images; an eftguard run's "
                          "use its dataset's public split: drop --public")
    args.method = args.method or family.cli_method
    methods = curious_methods(family.registry, getattr(args, "observe", None)) if args.method == "all" else \
        (args.method,)
    per_method = options_per_method(args, family, methods)
    out = args.out if args.out is not None else run / "reports"
    common = {"key": args.key, "out": out, **{o.name: getattr(args, o.name) for o in common_options_of(family)}}
    for method in methods:
        try:
            with stage_progress() as progress:
                report = run_attack(run, family.name, method, progress=progress, **common, **per_method[method])
        except AttackError as exc:  # --method all: a method this run does not suit is skipped, saying why
            if args.method != "all":
                raise
            console.print(f"skipped --method {method}: {exc}")
            continue
        print_summary(report, out / report.attack)


def attack_recorded_app(args: argparse.Namespace, family) -> None:
    """A run recorded from a user's Flower app (eftguard.federation.recorder): the attacks that take any classifier."""
    if family.name == "membership":
        attack_recorded_app_membership(args, family)
        return
    args.method = args.method or family.cli_method
    for method in app_methods(family.name) if args.method == "all" else (args.method,):
        cls = family.registry.get(method)
        options = {o.name: getattr(args, o.name) for o in options_of(cls) if hasattr(args, o.name)}
        if "seed" in {f.name for f in dataclasses.fields(cls)}:
            options["seed"] = args.seed
        results, report = run_app_attack(args.run, family.name, method, options, args.round_number,
                                         args.clients, args.out)
        table = Table(title=f"{family.name} {method}, {args.run}")
        columns = sorted({k for r in results for k, v in r.scores.items() if not isinstance(v, list)})
        for column in ["client", *columns]:
            table.add_column(column)
        for result in results:
            table.add_row(str(result.client), *(f"{result.scores.get(c, ''):.4g}" if isinstance(result.scores.get(c),
                                                float) else str(result.scores.get(c, "")) for c in columns))
        Console().print(table)
        console.print(f"report: {report}")


APP_MEMBERSHIP_OPTIONS = ("candidates", "references", "references_dir")  # the others read an eftguard run's uploads


def attack_recorded_app_membership(args: argparse.Namespace, family) -> None:
    """LiRA and RMIA on a recorded Flower app's global model, as its audit runs them (eftguard.app_audit), with the
    audit's defaults unless given, so that the two share their cached reference models."""
    methods = app_methods(family.name)
    chosen = methods if args.method in (None, "all") else (args.method,)
    if chosen[0] not in methods:
        raise AttackError(f"--method {args.method} on a recorded Flower app: its membership attacks are online "
                          f"{' | '.join(methods)} on the global model; use --method {' | '.join(methods)} | all")
    given = {o.name for o in family.options} | set(method_options(family))
    extra = sorted(name for name in given if hasattr(args, name) and name not in APP_MEMBERSHIP_OPTIONS
                   and not (name == "target" and args.target == "global"))
    if extra:
        raise AttackError(f"--{extra[0].replace('_', '-')} does not apply to a recorded Flower app's membership "
                          "attacks (online lira and rmia on its global model): drop it")
    if args.clients != "all":
        raise AttackError("--clients: a recorded Flower app's membership attacks read its global model, which every "
                          "client trained: drop --clients")
    if not args.power_check:
        raise AttackError("--no-power-check: a recorded Flower app's membership attacks always run their leave-one-out "
                          "control (it costs no training): drop it")
    sizes = {name: getattr(args, name) for name in ("references", "candidates") if hasattr(args, name)}
    for entry, report in attack_membership(args.run, chosen, args.public, args.round_number, args.seed,
                                           cache=getattr(args, "references_dir", None), out=args.out, **sizes):
        figures = ", ".join(f"{k} {v:.3f}" for k, v in entry["figures"].items() if isinstance(v, float))
        Console().print(f"{entry['attack']}: {entry['verdict']}; power check: {entry['power_check']}; {figures}",
                        soft_wrap=True, markup=False)
        console.print(f"report: {report}")


def curious_methods(registry, observe: str | None = None) -> tuple[str, ...]:
    """--method all: every method a curious server can run on the chosen --observe; those that read a round the
    server tampered with (threat model server "malicious") must be named."""
    return tuple(name for name, cls in registry.classes.items()
                 if not reads_a_tampered_round(cls) and (observe is None or observe in getattr(cls, "observes", (observe,))))


def named_only(registry) -> str:
    """--help's note on the methods that --method all leaves out."""
    left_out = sorted(set(registry.names()) - set(curious_methods(registry)))
    return f"; a malicious server's {', '.join(left_out)} only when named" if left_out else ""


def print_summary(report: AttackReport, folder: Path) -> None:
    """The attack's score table, as its report.md has it, on the console."""
    rows = summary_table(report)
    table = Table(title=f"{report.attack}, round {report.round}"
                        + (f", LPIPS: {report.lpips_backend}" if report.lpips_backend else ""))
    for column in rows[0]:
        table.add_column(column)
    for row in rows[1:]:
        table.add_row(*row)
    Console().print(table)
    console.print(f"report: {folder}/report.md")
