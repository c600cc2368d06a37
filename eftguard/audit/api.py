"""The one audit pipeline: run -> checks -> observation -> attack -> scoring -> AttackReport.

`run_attack` is what the CLI (`eftguard attack ...`), `eftguard demo`, the experiments and notebooks call:

    from eftguard.audit import run_attack
    report = run_attack("runs/eftvit", "invert", method="decoder", steps=600)
    report.figures()["psnr_kept"]

Every check runs before any work, so bad input is one clear error (AttackError or RunError) and leaves nothing
behind. Family-specific steps (observation, scoring) live in eftguard.audit.families.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as ProgressBars, TextColumn, TimeElapsedColumn

from eftguard import metrics
from eftguard.attack_report import AttackReport
from eftguard.attacks.base import AttackError, Progress, reads_a_tampered_round
from eftguard.audit.families import FAMILIES, Family, Job, family_named
from eftguard.methods import method_spec
from eftguard.options import SEED_LIMIT, option, options_of, whole_number
from eftguard.paths import input_file_problem, unwritable_reason
from eftguard.report import write_attack_report
from eftguard.retention import ranges
from eftguard.rundir import COHORT, SUM_ONLY, RunDirectory, RunError, client_name, round_name

SEED = whole_number(0, SEED_LIMIT)
ROUND = whole_number(1)


def partition_ids(text: str) -> str:
    """'all' or comma-separated partition ids, as given (round_clients reads it)."""
    parts = text.split(",")
    if text != "all" and not all(part.strip().isascii() and part.strip().isdigit() for part in parts):
        raise ValueError(f"must be 'all' or comma-separated partition ids, got '{text}'")
    return text


@dataclass(frozen=True)
class AttackRunOptions:
    """What every attack takes beside its family's and its method's options, declared once (eftguard.options):
    run_attack's keyword arguments, the attack commands' flags and an audit file's [[attack]] keys are checked
    from here."""

    round_number: int | None = option(None, "round whose uploads are attacked (default: the last completed round)",
                                      ROUND, flag="--round")
    clients: str = option("all", "'all' or comma-separated partition ids", partition_ids)
    seed: int = option(0, "seed of the attack's own randomness", SEED)  # of the families whose attacks draw
    lpips_backend: str = option("auto", "LPIPS implementation: lpips-alex (standard, needs torchvision's AlexNet "
                                        "weights in the torch hub cache or the network), stlpips-alex "
                                        "(shift-tolerant, weights shipped, offline); auto takes lpips-alex when it "
                                        "can. Reports name it", choices=metrics.LPIPS_BACKENDS, noun="backend")
    power_check: bool = option(True, "the power check: the same attack and budget on public images through the "
                                     "same channel with the defense off (docs/reports.md); without it a low verdict "
                                     "reads 'unchecked'")


COMMON_OPTIONS = {o.name: o for o in options_of(AttackRunOptions)}


def common_options(given: dict, error: type[Exception] = AttackError, as_written: bool = False) -> dict:
    """The common options given (by name), each checked against its declaration; clients may be a list of ids.
    as_written: errors name the option by its file key (round, not round_number)."""
    checked = {}
    for name, value in given.items():
        if name == "clients" and isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        option_ = COMMON_OPTIONS[name]
        checked[name] = option_.value(value, error, option_.key if as_written else None)
    return checked


def attack_names(family: str | None = None) -> list[str]:
    """Report names of every registered attack ("invert-decoder", ...), of one family or of all."""
    families = [family_named(family)] if family is not None else list(FAMILIES.values())
    return [f"{f.name}-{method}" for f in families for method in f.registry.names()]


def run_attack(run: str | Path | RunDirectory, family: str, method: str | None = None, *,
               round_number: int | None = None, clients: str | list[int] = "all", key: Path | None = None,
               seed: int = 0, lpips_backend: str = "auto", out: Path | None = None,
               progress: Progress | None = None, power_check: bool = True, **options) -> AttackReport:
    """Attack one round of a run and score the result. family: invert | labels | gradient; method None: the
    family's default; options: the family's and the method's options by name (steps=600, positions="known",
    ...). out: also write out/<attack>/ (report.json, report.md, grid.png). power_check: also run the family's
    positive control (Family.control) and store its figures beside the attack's; without it a "low" verdict
    reads "unchecked"."""
    chosen = family_named(family)
    common = common_options({"power_check": power_check, "seed": seed, "round_number": round_number,
                             "clients": clients, "lpips_backend": lpips_backend})
    seed, round_number, clients = common["seed"], common["round_number"], common["clients"]
    cls = chosen.registry.get(chosen.registry.default if method is None else method)
    family_options, method_options = resolve_options(chosen, cls, options)
    run_dir, round_number, picked = open_round(run, key, round_number, clients, chosen, cls)
    check_tampered(run_dir, round_number, cls)
    folder = out_root(run_dir, out) if out is not None else None
    ran_with = {**family_options, **method_options, **({"seed": seed} if chosen.seeded else {})}
    job = Job(run_dir, round_number, picked, seed, lpips_backend if chosen.image_metrics else None, family_options,
              ran_with)
    attack = chosen.attack(cls, job, method_options)
    observed = chosen.observe(job, attack)  # refuses a run without the channel ("not applicable")
    if chosen.image_metrics:
        metrics.load_lpips(lpips_backend)  # before the attack, which may run for minutes; cached: the scoring reuses it
    start = time.perf_counter()
    result = attack.reconstruct(observed.observation, progress)  # the attack phase: the observation only
    report = chosen.score(job, attack, observed, result, time.perf_counter() - start)
    if power_check:
        report = with_power_check(report, chosen, job, attack, observed, progress)
    if folder is not None:
        write_attack_report(folder, report)
    return report


def with_power_check(report: AttackReport, family: Family, job: Job, attack, observed, progress) -> AttackReport:
    """The report with its power check's groups and what the control was; a control that cannot be built here
    (too few public images, a schedule it cannot replay) leaves the report as it is, saying why (its low then reads
    "unchecked")."""
    try:
        control = family.control(job, attack, observed, progress)
    except (AttackError, RunError) as exc:
        return replace(report, details={**report.details, "power_check": f"not run: {exc}"})
    if control is None:
        return report
    groups, what = control
    return replace(report, groups={**report.groups, **groups}, details={**report.details, "power_check": what})


def resolve_options(family: Family, cls: type, given: dict) -> tuple[dict, dict]:
    """The family's and the method's options, given values checked and defaults filled in; an option neither
    takes is an AttackError listing the valid ones."""
    own, methods = {o.name: o for o in family.options}, {o.name: o for o in options_of(cls)}
    unknown = [name for name in given if name not in own and name not in methods]
    if unknown:
        valid = ", ".join([*own, *methods]) or "none"
        raise AttackError(f"{family.name} attack '{cls.name}' has no option '{unknown[0]}': its options are {valid}")
    return ({name: o.value(given[name], AttackError) if name in given else o.default for name, o in own.items()},
            {name: o.value(given[name], AttackError) if name in given else o.default for name, o in methods.items()})


# --- the checks before any work -----------------------------------------------------------------------------

def open_run(path: str | Path | RunDirectory, key: Path | None) -> RunDirectory:
    """Open a run for auditing; an encrypted run needs its key (refused clearly without it)."""
    if isinstance(path, RunDirectory):
        run = path
    else:
        path = Path(path)
        if path.is_file():
            raise RunError(f"{path} is a file, not a run directory: give the run's folder (e.g. runs/NAME)")
        run = RunDirectory.open(path, key)
    if run.encrypted and run.key is None:
        raise RunError(f"{run.path} stores its uploads encrypted at rest: pass --key KEYFILE "
                       "(the file given to eftguard train --encrypt-at-rest)")
    return run


def resolve_round(run: RunDirectory, round_number: int | None) -> int:
    completed = run.completed_rounds()
    if completed == 0:
        raise RunError(f"{run.path} has no completed round to attack: train it first (or --resume it)")
    if round_number is None:
        round_number = completed
    elif not 1 <= round_number <= completed:
        raise RunError(f"--round {round_number} is not a completed round of {run.path} (choose 1..{completed})")
    retention = run.retention
    if round_number not in retention.rounds_kept:
        kept = [t for t in retention.rounds_kept if t <= completed]
        raise RunError(f"round {round_number} of {run.path} was not kept (--keep-rounds {retention.keep_rounds}): "
                       f"rounds with uploads to attack: {ranges(kept)}")
    return round_number


def round_clients(run: RunDirectory, round_number: int, choice: str = "all") -> list[int]:
    """Partitions with uploads in the round: all, or the comma-separated partition ids of choice (partition_ids)."""
    present = run.uploaded_partitions(round_number)
    if not present and run.config().secagg:
        raise RunError(SUM_ONLY)
    if not present:
        raise RunError(f"{run.upload_dir(round_number, 0).parent} holds no uploads")
    if choice == "all":
        return present
    wanted = sorted({int(c) for c in choice.split(",")})
    missing = [c for c in wanted if c not in present]
    if missing or not wanted:
        raise RunError(f"no uploads of client(s) {missing} in round {round_number}; clients with uploads: {present}"
                       f"{run.kept_uploads_note()}")
    return wanted


def out_root(run: RunDirectory, out: Path | None, flag: str = "--out") -> Path:
    """The reports folder (default RUN/reports), refused before any work when a file is in its way."""
    folder = Path(out) if out is not None else run.path / "reports"
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        where = "exists and is not a folder" if existing == folder.absolute() else f"lies under {existing}, a file"
        raise RunError(f"{folder} {where}: pass {flag} with a folder for the reports")
    reason = unwritable_reason(existing)
    if reason is not None:
        raise RunError(f"cannot write reports to {folder} ({existing} is not writable: {reason}): pass {flag} with "
                       "another folder")
    return folder


def check_intact(run: RunDirectory, round_number: int, clients: list[int]) -> None:
    """Before any work: config.toml and every file the attack and its scoring read (start checkpoint, the
    clients' uploads and truth) must exist and still hash to what manifest.json recorded when they were
    written; a missing, truncated or altered file is named instead of failing deep inside a loader."""
    start = run.checkpoint_path(round_number - 1)
    if not start.is_file():
        raise RunError(f"{start} is missing: it holds the weights round {round_number} started from. Restore it from "
                       "a backup, or attack another --round")
    run.check_config()
    read = (f"checkpoints/{round_name(round_number - 1)}.",
            *(f"{folder}/{round_name(round_number)}/{client_name(k)}{end}"
              for k in clients for folder, end in (("observed", "/"), ("truth", "."))))
    for name in run.verify(read):
        file = run.path / name
        problem = input_file_problem(file)
        if problem is not None:
            missing = "is missing" if problem == "does not exist" else problem
            raise RunError(f"{file} {missing} (manifest.json lists it as a file): restore it from a backup, or attack "
                           "another --round")
        raise RunError(f"{file} is damaged: it no longer matches the sha256 manifest.json recorded when it was "
                       "written (truncated or altered). Restore it from a backup, or attack another --round")


def check_round_record(run: RunDirectory, round_number: int, clients: list[int]) -> None:
    """metrics.jsonl grows every round, so the manifest cannot vouch for it: the round's record must hold what the
    attacks read per client, n_k as a positive count and, for DP runs, finite noise multipliers (DP-SGD's and,
    where features are uploaded, the feature release's)."""
    record = run.metrics()[round_number - 1]
    checks = {"num_examples": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0}
    cfg = run.config()
    if cfg.dp_eps > 0:
        def noise(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        checks["noise_multiplier"] = noise
        if method_spec(cfg.method).uploads_features:
            checks["feature_noise_multiplier"] = noise
    for key, valid in checks.items():
        values = record.get(key) if isinstance(record.get(key), dict) else {}
        for partition in clients:
            if not valid(values.get(str(partition))):
                raise RunError(f"{run.path / 'metrics.jsonl'} has no valid {key} of client {partition} in round "
                               f"{round_number} (got {values.get(str(partition))!r}): restore the file the run wrote")


def check_model_loads(run: RunDirectory, round_number: int) -> None:
    """config.toml must still describe the checkpoints (a changed model, split or class count is one line)."""
    try:
        run.start_model(round_number)
    except RuntimeError as exc:  # load_state_dict: missing, unexpected or differently shaped weights
        first = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), str(exc))
        raise RunError(f"{run.path}/config.toml does not match {run.checkpoint_path(round_number - 1).name} "
                       f"({first[:160]}): restore the config.toml the run was trained with") from None


def check_tampered(run: RunDirectory, round_number: int, cls: type) -> None:
    """A malicious server's attack (threat model server "malicious") reads a round whose model the server crafted:
    on a round that was not tampered with, its figures would measure nothing, so it is refused, saying so."""
    if not reads_a_tampered_round(cls):
        return
    records = run.metrics()
    if records[round_number - 1].get("tampered") is None:
        tampered = [record.get("round") for record in records if record.get("tampered")]
        if not tampered:
            raise AttackError(f"{run.path} was never tampered with: the {cls.name} method reads a round whose model "
                              "a malicious server crafted (eftguard train --threat malicious --tamper NAME); use "
                              "another --method")
        raise AttackError(f"round {round_number} of {run.path} was not tampered with: the {cls.name} method reads the "
                          f"round a malicious server crafted; attack --round {tampered[0]}")


def open_round(path: str | Path | RunDirectory, key: Path | None, round_number: int | None,
               choice: str, family: Family, cls: type) -> tuple[RunDirectory, int, list[int]]:
    """The checks of the run an attack needs before it starts: the run, its round, the chosen clients with
    uploads, intact files, weights that load."""
    run = open_run(path, key)
    round_number = resolve_round(run, round_number)
    if family.on_the_sum(run, round_number, cls):  # the server holds no client's update, only the sum
        if choice != "all":
            raise RunError(f"{run.path} is a --secagg run: the {family.name} attack reads the cohort's sum, not one "
                           "client's update: drop --clients")
        check_intact(run, round_number, [])
        if not run.cohort(round_number):
            raise RunError(f"round {round_number} of {run.path} has no sum to attack: fewer clients than SecAgg+ needs "
                           "stayed to the end of it (its cohort in metrics.jsonl is empty) and the model did not move; "
                           "attack another --round")
        if run.verify((f"observed/{round_name(round_number)}/aggregate",)):
            raise RunError(f"{run.aggregate_path(round_number)} is missing or damaged (it no longer matches the sha256 "
                           "manifest.json recorded): restore it from a backup, or attack another --round")
        check_round_record(run, round_number, run.cohort(round_number))
        return run, round_number, [COHORT]
    clients = family.pick_clients(round_clients(run, round_number, choice), choice)
    check_intact(run, round_number, clients)
    check_round_record(run, round_number, clients)
    check_model_loads(run, round_number)
    return run, round_number, clients


@contextmanager
def stage_progress():
    """A (stage, done, total) callback for run_attack's progress= (the attacks' long loops), drawn as rich progress
    bars on stderr; the display starts with the first call, so an error before any work prints nothing but its one
    line."""
    bar = ProgressBars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=Console(stderr=True), transient=False)
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        if done == total or done % 10 == 0:
            bar.update(tasks[stage], completed=done)

    try:
        yield update
    finally:
        if tasks:
            bar.stop()
