"""`eftguard audit AUDIT.toml`: train every configuration of a grid, run every attack of the audit on each run,
and sum the results up in summary.json (rendered as report.html and report.md). Format: docs/audit.md.

Everything is kept so that an interrupted audit continues where it stopped and shards merge:

    OUT/summary.json, report.html, report.md    (a --shard I/N run: OUT/shards/I-of-N/summary.json, ...)
    OUT/runs/<id>-<digest>/          the run of a configuration; digest of its resolved config and the code version,
    OUT/runs/<id>-<digest>.json      so a changed config or code trains anew; beside it: code version, train seconds
    OUT/reports/<id>/<attack>/...    attack reports, as run_attack(out=...) writes them
    OUT/configurations/<id>.json     a configuration's result, rewritten atomically after training and each attack
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from rich.console import Console
from rich.table import Table

import eftguard.attacks
import eftguard.defenses
from eftguard import audit as api, runs
from eftguard.attacks.base import AttackError
from eftguard.audit import gate as gates_module
from eftguard.audit.api import COMMON_OPTIONS, common_options, resolve_options, stage_progress
from eftguard.audit.families import FAMILIES
from eftguard.config import TrainConfig, read_toml
from eftguard.data import DataError
from eftguard.errors import ConfigError
from eftguard.model import ModelError
from eftguard.paths import atomic_write, read_text_file
from eftguard.report import write_audit_report
from eftguard.rundir import RunDirectory, RunError

SCHEMA_VERSION = 1
AUDIT_KEYS = ("title", "train", "grid", "attack")
# run_attack arguments the audit sets itself, not an [[attack]] table
RESERVED_ATTACK_KEYS = ("run", "key", "out", "progress")
# an [[attack]] table's keys for the options every family takes (round_number's is round); any other key is a
# family or method option
COMMON_KEYS = {option.key: name for name, option in COMMON_OPTIONS.items()}
SAFE_NAME = re.compile(r"(?!\.+$)[A-Za-z0-9._=,+-]{1,100}")  # a folder name, and never . or .. (this or the parent)
GRID_LIMIT = 10_000  # configurations of one audit: each is a training of minutes (--shard spreads one over machines)

console = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)  # ids and errors printed as they are


# --- the audit file ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttackEntry:
    """One [[attack]] table: run_attack(run, family, method, **options); name is its key in summary.json."""

    name: str
    family: str
    method: str
    options: dict


@dataclass(frozen=True)
class Configuration:
    id: str                 # "method=eftvit,mask_ratio=0.5,seed=1": the varied options, sorted by name
    varied: dict
    config: TrainConfig     # resolved

    @property
    def group(self) -> str:
        """The id without the seed: error bars over seeds are taken within a group."""
        return format_id({k: v for k, v in self.varied.items() if k != "seed"})

    @property
    def folder(self) -> str:
        """The id as a file name; ids with other characters (paths in data_dir) get a digest instead."""
        if SAFE_NAME.fullmatch(self.id):
            return self.id
        return re.sub(r"[^A-Za-z0-9._=,+-]", "_", self.id)[:60] + "-" + digest(self.id)[:10]


@dataclass
class Audit:
    source: str
    title: str
    defaults: TrainConfig   # TrainConfig with the audit's [train] options
    configurations: list[Configuration]   # sorted by id
    attacks: list[AttackEntry] = field(default_factory=list)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def format_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def format_id(varied: dict) -> str:
    return ",".join(f"{name}={format_value(varied[name])}" for name in sorted(varied)) or "default"


def read_audit(path: Path) -> Audit:
    return parse_audit(read_toml(path, "audit file"), str(path))


def parse_audit(data: dict, source: str) -> Audit:
    """Validate an audit (a TOML file's tables) completely, so that a bad one fails before any training."""
    for key in data:
        if key not in AUDIT_KEYS:
            raise ConfigError(f"{source}: unknown key '{key}'; an audit file has {', '.join(AUDIT_KEYS)} "
                              "(training options go under [train] or [grid])")
    title = data.get("title", Path(source).stem)
    if not isinstance(title, str):
        raise ConfigError(f"{source}: title must be a string, e.g. title = \"mask-ratio sweep\"")
    train = data.get("train", {})
    if not isinstance(train, dict):
        raise ConfigError(f"{source}: train must be a table: [train] with one training option per line")
    defaults = TrainConfig.from_mapping(train, f"{source} [train]")
    if defaults.encrypt_at_rest:
        defaults.encrypt_at_rest = str(Path(defaults.encrypt_at_rest).resolve())
    configurations = expand_grid(data.get("grid", {}), defaults, source)
    return Audit(source, title, defaults, configurations, attack_entries(data.get("attack", []), source))


def expand_grid(grid, defaults: TrainConfig, source: str) -> list[Configuration]:
    """[grid] is one cartesian product of option lists, [[grid]] several whose products are united. The id of
    every configuration names every option any grid varies, so equal configurations from two grids are one."""
    tables = [grid] if isinstance(grid, dict) else grid
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{source}: grid must be a [grid] table of option lists, or [[grid]] tables")
    wheres = [f"{source} [grid]"] if isinstance(grid, dict) else [f"{source} [[grid]] #{i}" for i in
                                                                   range(1, len(tables) + 1)]
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    products = []
    for table, where in zip(tables, wheres):
        options = {}
        for key, values in table.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"{where}: unknown option '{key}'; known: {', '.join(sorted(known))}")
            if not isinstance(values, list) or not values:
                raise ConfigError(f"{where}: {key} must be a non-empty list of values, e.g. "
                                  f"{key} = [{json.dumps(getattr(defaults, name))}]")
            options[name] = values
        products.append((options, where))
    count = sum(math.prod(len(values) for values in options.values()) for options, _ in products)
    if count > GRID_LIMIT:
        raise ConfigError(f"{source}: the grid has {count} configurations, more than an audit can train "
                          f"({GRID_LIMIT}): split it into smaller audits")
    varied_names = sorted({name for options, _ in products for name in options})
    configurations = {}
    for options, where in products:
        for values in itertools.product(*options.values()):
            chosen = dict(zip(options, values))
            cfg = TrainConfig.from_mapping({**dataclasses.asdict(defaults), **chosen}, where)
            varied = {name: getattr(cfg, name) for name in varied_names}
            config_id = format_id(varied)
            try:
                resolved = cfg.resolved()
            except (ConfigError, DataError) as exc:
                raise ConfigError(f"{where}: configuration {config_id}: {exc}") from None
            configurations[config_id] = Configuration(config_id, varied, resolved)
    return [configurations[i] for i in sorted(configurations)]


def attack_entries(tables, source: str) -> list[AttackEntry]:
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{source}: attacks are [[attack]] tables, each with family = " + " | ".join(
            f'"{name}"' for name in FAMILIES))
    entries = {}
    for index, table in enumerate(tables, start=1):
        where = f"{source} [[attack]] #{index}"
        family, method, name = table.get("family"), table.get("method"), table.get("name")
        if family not in FAMILIES:
            raise ConfigError(f"{where}: family must be one of {', '.join(FAMILIES)}, got {family!r}")
        methods = FAMILIES[family].registry.names()
        if method is not None and method not in methods:
            raise ConfigError(f"{where}: {family} has no method {method!r}; methods: {', '.join(methods)}")
        method = method or FAMILIES[family].registry.default
        name = name if name is not None else f"{family}-{method}"
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise ConfigError(f"{where}: name must be letters, digits and . _ = , + -, not dots alone (it names a "
                              f"folder), got {name!r}")
        if name in entries:
            raise ConfigError(f"{where}: a second attack named '{name}': give each a distinct name = \"...\"")
        options = {key.replace("-", "_"): value for key, value in table.items() if key not in ("family", "method", "name")}
        options = {COMMON_KEYS.get(key, key): value for key, value in options.items()}  # round -> round_number
        reserved = [key for key in options if key in RESERVED_ATTACK_KEYS]
        if reserved:
            raise ConfigError(f"{where}: '{reserved[0]}' is set by eftguard audit (the run it trains, --out, --key): "
                              "remove it")
        check_attack_options(family, method, options, where)
        entries[name] = AttackEntry(name, family, method, options)
    return list(entries.values())


def check_attack_options(family: str, method: str, options: dict, where: str) -> None:
    """Every option checked as run_attack checks it, before any training: at run time an AttackError means
    "does not apply to this run", so a typo must not get that far."""
    try:
        chosen = FAMILIES[family]
        resolve_options(chosen, chosen.registry.get(method),
                        {k: v for k, v in options.items() if k not in COMMON_OPTIONS})
        common_options({k: v for k, v in options.items() if k in COMMON_OPTIONS}, as_written=True)
    except AttackError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# --- code version and reuse -------------------------------------------------------------------------------

@functools.cache
def code_version() -> str:
    """The package version plus a digest of every source module of eftguard: a run or report is reused only when
    the code that would make it again is the code that made it. eftguard.attacks and eftguard.defenses have their
    own folders in the repository and sit inside eftguard's once installed: each module is counted once, by name."""
    sources = {}
    for package in (eftguard, eftguard.attacks, eftguard.defenses):
        root = Path(package.__file__).parent
        for file in root.rglob("*.py"):
            sources[".".join((package.__name__, *file.relative_to(root).with_suffix("").parts))] = file
    hasher = hashlib.sha256()
    for module, file in sorted(sources.items()):
        hasher.update(f"{module}\n".encode())
        hasher.update(file.read_bytes())
    return f"{version('eftguard')}+{hasher.hexdigest()[:12]}"


def run_folder(out: Path, configuration: Configuration) -> Path:
    key = digest(configuration.config.to_toml() + code_version())[:10]
    return out / "runs" / f"{configuration.folder}-{key}"


def reports_folder(out: Path, configuration: Configuration, attack: AttackEntry) -> Path:
    """Where run_attack writes <attack>/report.json: one folder per configuration; an attack named in the file
    gets its own, so two entries of one attack with other options keep both reports."""
    folder = out / "reports" / configuration.folder
    return folder if attack.name == f"{attack.family}-{attack.method}" else folder / attack.name


def result_file(out: Path, configuration: Configuration) -> Path:
    return out / "configurations" / f"{configuration.folder}.json"


def read_json(path: Path) -> dict | None:
    """A JSON object written by this module, or None when it is missing or damaged (it is then made again)."""
    try:
        data = json.loads(read_text_file(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps(data, indent=2) + "\n"))


def ensure_trained(run_dir: Path, cfg: TrainConfig, verbose: bool) -> float:
    """A finished run of cfg in run_dir: reused when it is finished, resumed when it is not, trained when absent
    (through `eftguard train`'s code path). Returns its training seconds over every session."""
    record_file = run_dir.with_name(run_dir.name + ".json")
    record = read_json(record_file)
    if (run_dir / "manifest.json").exists():
        run = RunDirectory.open(run_dir)
        run.check_config()
        if record is None or record.get("code_version") != code_version() or run.config() != cfg:
            raise RunError(f"{run_dir} holds a run of another configuration or code version: remove it, and its "
                           f"{record_file.name}, to train it again")
        done = run.completed_rounds()
        if done == cfg.rounds:
            console.print(f"  reusing the finished run {run_dir}")
            return record["train_seconds"]
        done = runs.resume_run(run)
        console.print(f"  resuming {run_dir} after round {done} of {cfg.rounds}")
        undo = None
    else:
        record = {"code_version": code_version(), "train_seconds": 0.0}
        write_json(record_file, record)
        undo = runs.create_run(run_dir, cfg)
        console.print(f"  training {cfg.rounds} rounds, {cfg.clients} clients -> {run_dir}")
    start = time.perf_counter()
    runs.train_run(run_dir, verbose, undo=undo)
    record["train_seconds"] += time.perf_counter() - start
    write_json(record_file, record)
    return record["train_seconds"]


# --- running an audit -------------------------------------------------------------------------------------

def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, (ConfigError, RunError, AttackError)) else f"{type(exc).__name__}: {text}"


def attack_fingerprint(run: RunDirectory, attack: AttackEntry, key: Path | None) -> str:
    """What an attack report depends on: the run's identity and rounds, the attack and its options, the code."""
    return digest(json.dumps({"run": run.run_id, "rounds": run.completed_rounds(), "code": code_version(),
                              "family": attack.family, "method": attack.method, "options": attack.options,
                              "encrypted": key is not None}, sort_keys=True, default=str))


def run_one_attack(run_dir: Path, attack: AttackEntry, out: Path, reports: Path, key: Path | None,
                   previous: dict | None) -> dict:
    """One attack's entry in summary.json: reused when the report for the same run state and options exists;
    "not applicable" when the attack refuses the run (invert on a run that uploads no features)."""
    fingerprint = attack_fingerprint(RunDirectory.open(run_dir, key), attack, key)
    if previous and previous.get("fingerprint") == fingerprint and reusable(previous, out):
        console.print(f"  {attack.name}: reusing its report")
        return previous
    start = time.perf_counter()
    try:
        with stage_progress() as progress:
            report = api.run_attack(run_dir, attack.family, attack.method, key=key, out=reports, progress=progress,
                                    **{**shared_caches(attack, out), **attack.options})
    except (AttackError, RunError) as exc:
        console.print(f"  {attack.name}: not applicable: {one_line(exc)}")
        return {"family": attack.family, "status": "not applicable", "reason": one_line(exc), "fingerprint": fingerprint}
    figures = report.figures()
    console.print(f"  {attack.name}: {headline_text(report.family, figures)} ({time.perf_counter() - start:.0f} s)")
    report_path = reports / report.attack / "report.json"
    return {"family": report.family, "method": report.method, "status": "done",
            "report": os.path.relpath(report_path, out), "figures": figures, "fingerprint": fingerprint}


def shared_caches(attack: AttackEntry, out: Path) -> dict:
    """Caches that every configuration of an audit shares unless the [[attack]] table names its own: membership's
    reference models and the DP audit's model-channel control run (keyed by configuration and data, so a
    configuration finds only its own, and a DP one's power check finds the models of the same configuration without
    DP trained)."""
    caches = {"membership": {"references_dir": out / "membership-references"},
              "dp-audit": {"control_dir": out / "dp-audit-control"}}
    return caches.get(attack.family, {})


def reusable(previous: dict, out: Path) -> bool:
    """A recorded "not applicable", or a report that still reads back with the figures recorded from it."""
    if previous.get("status") == "not applicable":
        return True
    try:
        return previous.get("status") == "done" and api.read_attack_report(out / previous["report"]).figures() == \
            previous["figures"]
    except (RunError, KeyError, TypeError):
        return False


def headline_text(family: str, figures: dict) -> str:
    """The first of the family's headline figures the attack reported (its console line and final table cell)."""
    headlines = FAMILIES[family].channel.headlines if family in FAMILIES else ()
    name = next((h.figure for h in headlines if h.figure in figures), None)
    value = figures.get(name) if name else None
    return f"{name} {value:.3f}" if isinstance(value, (int, float)) else "no figures"


def audit_configuration(audit: Audit, configuration: Configuration, out: Path, key: Path | None,
                        verbose: bool) -> dict:
    """Train one configuration and attack it; a failure is recorded in its entry, never raised (an interrupt is)."""
    file = result_file(out, configuration)
    previous = read_json(file) or {}
    if previous.get("config_digest") != digest(configuration.config.to_toml()):
        previous = {}
    run_dir = run_folder(out, configuration)
    entry = {"id": configuration.id, "varied": configuration.varied, "group": configuration.group,
             "run": os.path.relpath(run_dir, out), "status": "incomplete", "error": None, "accuracy": None,
             "epsilon": None, "epsilon_channels": None, "train_seconds": None, "attacks": {},
             "config_digest": digest(configuration.config.to_toml()), "code_version": code_version()}
    try:
        entry["train_seconds"] = round(ensure_trained(run_dir, configuration.config, verbose), 1)
    except Exception as exc:  # noqa: BLE001 - any failure of one configuration is recorded; the others go on
        entry.update(status="failed", error=f"training: {one_line(exc)}")
        write_json(file, entry)
        return entry
    records = RunDirectory.open(run_dir).metrics()
    entry.update(accuracy=records[-1].get("test_accuracy"), epsilon=spent_epsilon(records),
                 epsilon_channels=spent_per_channel(records))
    write_json(file, entry)
    cfg = configuration.config
    run_key = key or (Path(cfg.encrypt_at_rest) if cfg.encrypt_at_rest else None)
    errors = []
    for attack in audit.attacks:
        try:
            result = run_one_attack(run_dir, attack, out, reports_folder(out, configuration, attack), run_key,
                                    previous.get("attacks", {}).get(attack.name))
        except Exception as exc:  # noqa: BLE001
            result = {"family": attack.family, "status": "failed", "error": one_line(exc)}
            errors.append(f"{attack.name}: {one_line(exc)}")
            console.print(f"  {attack.name}: failed: {one_line(exc)}")
        entry["attacks"][attack.name] = result
        write_json(file, entry)
    entry.update(status="failed" if errors else "done", error="; ".join(errors) or None)
    write_json(file, entry)
    return entry


def spent_epsilon(records: list[dict], key: str = "epsilon") -> float | None:
    """The largest ε any client reported spent (metrics.jsonl: per round, {client: ε} or null): the guarantee
    of the run is that of its weakest client."""
    spent = [value for record in records for value in (record.get(key) or {}).values()]
    return max(spent) if spent else None


def spent_per_channel(records: list[dict]) -> dict[str, float] | None:
    """{"parameters": ε, "features": ε}, each the largest any client reported (None without DP)."""
    channels = {channel: spent_epsilon(records, f"epsilon_{channel}") for channel in ("parameters", "features")}
    return {c: e for c, e in channels.items() if e is not None} or None


def select_shard(configurations: list, shard: tuple[int, int] | None) -> list:
    """Shard I of N: every N-th configuration of the sorted ids from the I-th (1-based)."""
    if shard is None:
        return configurations
    index, count = shard
    return configurations[index - 1::count]


def parse_shard(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise ConfigError(f"--shard must be I/N with 1 <= I <= N (this machine's share of N), e.g. --shard 2/4; "
                          f"got '{text}'")
    return int(match.group(1)), int(match.group(2))


def collect(audit: Audit, out: Path) -> tuple[list[dict], list[str]]:
    """The results of every configuration on disk (this shard's and other shards'), and the ids still pending."""
    results, pending = [], []
    for configuration in audit.configurations:
        data = read_json(result_file(out, configuration))
        if (data and data.get("status") in ("done", "failed") and data.get("id") == configuration.id
                and data.get("config_digest") == digest(configuration.config.to_toml())):
            results.append(data)
        else:
            pending.append(configuration.id)
    return results, pending


def check_data_and_model(audit: Audit, configurations: list[Configuration], out: Path) -> None:
    """Before any training, what `eftguard train` checks before its first round (the data loads, the model and
    checkpoint fit, DP-SGD is feasible) for every configuration that has no run yet: a grid cell that can never
    train is a bad audit file, not a failure found hours later."""
    for configuration in configurations:
        if not (run_folder(out, configuration) / "manifest.json").exists():
            try:
                runs.prepare(configuration.config)
            except (ConfigError, DataError, ModelError) as exc:
                raise ConfigError(f"{audit.source}: configuration {configuration.id}: {exc}") from None


def run_audit(audit: Audit, out: Path, gates: list | None = None, shard: tuple[int, int] | None = None,
              key: Path | None = None, verbose: bool = False) -> dict:
    """Run (or continue) an audit into out and write summary.json and the report (a shard: in
    out/shards/I-of-N/, so that shards finishing together do not write one file); returns the summary.
    A gate naming a figure no attack reports raises ConfigError after the summary is written."""
    gates = gates or []
    gates_module.check_before_training(gates, set(FAMILIES), {a.name for a in audit.attacks})
    chosen = select_shard(audit.configurations, shard)
    check_data_and_model(audit, chosen, out)
    where = f", shard {shard[0]}/{shard[1]}" if shard else ""
    console.print(f"{audit.title}: {len(chosen)} of {len(audit.configurations)} configurations{where}, "
                  f"{len(audit.attacks)} attacks each -> {out}")
    audit_configurations(audit, chosen, out, key, verbose)
    return finish_audit(audit, out, gates, shard)


def audit_configurations(audit: Audit, chosen: list[Configuration], out: Path, key: Path | None = None,
                         verbose: bool = False, command: str = "eftguard audit") -> None:
    """Train and attack the chosen configurations one after the other; an interrupt keeps what finished and
    exits 130, saying that the same command continues."""
    try:
        for number, configuration in enumerate(chosen, start=1):
            console.print(f"[{number}/{len(chosen)}] {configuration.id}")
            audit_configuration(audit, configuration, out, key, verbose)
    except (KeyboardInterrupt, SystemExit) as stop:
        if isinstance(stop, SystemExit) and stop.code != 130:
            raise
        console.print(f"interrupted: finished configurations and attacks are kept; run the same {command} "
                      f"command again (same --out {out}) to continue")
        raise SystemExit(130) from None


def finish_audit(audit: Audit, out: Path, gates: list, shard: tuple[int, int] | None = None) -> dict:
    """summary.json and the report of whatever configurations are on disk (see run_audit); returns the summary."""
    results, pending = collect(audit, out)
    summary = {"schema_version": SCHEMA_VERSION, "audit_file": audit.source, "title": audit.title,
               "defaults": dataclasses.asdict(audit.defaults), "code_version": code_version(),
               "configurations": results, "pending": pending, "gates": []}
    gate_error = None
    try:
        gates_module.check_figures(gates, results)
        summary["gates"] = gates_module.evaluate(gates, [r for r in results if r["status"] == "done"])
    except ConfigError as exc:
        gate_error = exc
    folder = out if shard is None else out / "shards" / f"{shard[0]}-of-{shard[1]}"  # shards finish at once
    write_json(folder / "summary.json", summary)
    write_report(summary, folder)
    if gate_error:
        raise gate_error
    return summary


def write_report(summary: dict, out: Path) -> None:
    for file in write_audit_report(summary, out):
        console.print(f"wrote {file}")


def problems(summary: dict) -> list[str]:
    """One line per failed configuration and per gate crossing, for the exit status of an audit."""
    lines = [f"configuration {c['id']} failed: {c['error']}" for c in summary["configurations"] if c["status"] == "failed"]
    for gate in summary["gates"]:
        lines += [f"gate '{gate['expression']}' does not hold for {f['configuration']}: {f['figure']} = "
                  + (f"{f['value']:.3f}" if f["value"] is not None else "NaN") for f in gate["failures"]]
    return lines


def print_summary(summary: dict) -> None:
    """The final table: one row per configuration, one column per attack (its headline figure)."""
    attacks = list(dict.fromkeys(name for c in summary["configurations"] for name in c["attacks"]))
    table = Table(title=f"{summary['title']}: {len(summary['configurations'])} configurations"
                        + (f", {len(summary['pending'])} pending" if summary["pending"] else ""))
    for column in ("configuration", "status", "accuracy", "epsilon", "train s", *attacks):
        table.add_column(column)
    for c in summary["configurations"]:
        cells = [attack_cell(c["attacks"].get(name)) for name in attacks]
        table.add_row(c["id"], c["status"], number_text(c["accuracy"]), number_text(c["epsilon"], 2),
                      number_text(c["train_seconds"], 0), *cells)
    stdout = Console()
    if not stdout.is_terminal:  # a log file or a CI job: whole ids and figures, not folded into 80 columns
        stdout.width = 240
    stdout.print(table)
    for gate in summary["gates"]:
        console.print(f"gate '{gate['expression']}': " + ("holds" if gate["passed"] else
                                                          f"crossed {len(gate['failures'])} times"))


def attack_cell(entry: dict | None) -> str:
    if entry is None:
        return "–"
    return headline_text(entry["family"], entry["figures"]) if entry["status"] == "done" else entry["status"]


def number_text(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "–"
