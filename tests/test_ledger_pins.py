"""The node's privacy ledger, called directly (no round, no grid): each test is a way a node could over- or
under-count what it spent, or trust a file it should not. Fast enough for the mutation check of
defenses/ledger.py (docs/mutation.md); tests/test_ledger.py tries the same ledger through real rounds."""

import fcntl
import hashlib
import json
import math
import re

import pytest

from eftguard.defenses.dp import PrivacyBudgetError
from eftguard.defenses.ledger import LedgerError, PrivacyLedger, Spend, Terms, compose

RUN_ID = "feedfacecafebeef0123456789abcdef"
TERMS = Terms(3.0, 1e-3, "rdp")
ROUND_1 = Spend(1, 1.0, 0.25, 4)  # epsilon 3.17 at delta 1e-3 (rdp): over TERMS' budget on its own
QUIET = Spend(1, 2.0, 0.25, 4)  # well within TERMS
SPLIT = Terms(3.0, 1e-3, "rdp", 0.5)  # a run that uploads features: both channels share the budget
RELEASE = Spend(1, 3.0, 1.0, 1, "features")  # one Gaussian release of every image


def spent(spends, terms=TERMS):
    """What record returns: each channel alone and the total, all at the run's delta."""
    channels = ("parameters", "features") if terms.feature_share else ("parameters",)
    return {channel: compose([s for s in spends if s.channel == channel], terms.delta, terms.accountant)
            for channel in channels} | {"total": compose(spends, terms.delta, terms.accountant)}


def sha256_of(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def chained(entries, terms=TERMS, partition=0):
    """Ledger entries as a node writes them: each names the sha256 of the one before (of its sorted JSON), the
    first the sha256 of [run id, partition, terms] (written out here, independently of the ledger's helpers)."""
    previous = sha256_of([RUN_ID, partition, {"declared_epsilon": terms.declared_epsilon, "delta": terms.delta,
                                              "accountant": terms.accountant, "feature_share": terms.feature_share}])
    out = []
    for entry in entries:
        out.append({**entry, "previous": previous})
        previous = sha256_of(out[-1])
    return out


def ledger_json(ledger, run_id=RUN_ID):
    return json.loads(ledger.path(run_id).read_text())


def write_ledger(ledger, **changes):
    """A ledger file as _write would leave it after one QUIET round, with some fields changed (a hand edit)."""
    ledger.record(RUN_ID, TERMS, [QUIET])
    data = {**ledger_json(ledger), **changes}
    ledger.path(RUN_ID).write_text(json.dumps(data))


# --- composition ------------------------------------------------------------------------------------------------

def test_nothing_spent_composes_to_zero_and_a_noiseless_round_to_infinity():
    assert compose([], 1e-3, "rdp") == 0.0
    assert compose([QUIET, Spend(2, 0.0, 0.25, 4)], 1e-3, "prv") == math.inf  # prv would crash on sigma 0


def test_rounds_with_other_sample_rates_are_not_merged():
    """A round at a larger sample rate spends more than one at the first round's rate."""
    mixed = compose([QUIET, Spend(2, 2.0, 0.5, 4)], 1e-3, "rdp")
    assert mixed > compose([QUIET, Spend(2, 2.0, 0.25, 4)], 1e-3, "rdp")
    assert mixed == pytest.approx(compose([Spend(2, 2.0, 0.5, 4), QUIET], 1e-3, "rdp"))


# --- the file ---------------------------------------------------------------------------------------------------

def test_ledger_file_holds_the_terms_and_every_spend_with_its_running_epsilon(tmp_path):
    ledger = PrivacyLedger(tmp_path, 3)
    second = Spend(2, 2.0, 0.25, 3)
    assert ledger.record(RUN_ID, TERMS, [QUIET]) == spent([QUIET])
    assert ledger.record(RUN_ID, TERMS, [second]) == spent([QUIET, second])
    path = tmp_path / f"{RUN_ID}-client-03.json"
    assert ledger.path(RUN_ID) == path and path.read_text().endswith("}\n")
    assert json.loads(path.read_text()) == {
        "format": "eftguard-privacy-ledger", "format_version": 2, "run_id": RUN_ID, "partition": 3,
        "terms": {"declared_epsilon": 3.0, "delta": 1e-3, "accountant": "rdp", "feature_share": 0.0},
        "entries": chained([
            {"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 0.25, "steps": 4, "channel": "parameters"},
             "delta": 1e-3, "epsilon_after": compose([QUIET], 1e-3, "rdp")},
            {"spend": {"round": 2, "noise_multiplier": 2.0, "sample_rate": 0.25, "steps": 3, "channel": "parameters"},
             "delta": 1e-3, "epsilon_after": compose([QUIET, second], 1e-3, "rdp")}], partition=3)}
    assert ledger.read(RUN_ID) == (TERMS, [QUIET, second])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind; the mark is elsewhere
    mark = json.loads(ledger.mark_path(RUN_ID).read_text())
    assert not ledger.mark_path(RUN_ID).is_relative_to(tmp_path)
    assert (mark["entries"], mark["head"]) == (2, sha256_of(json.loads(path.read_text())["entries"][-1]))


def test_a_round_of_a_split_run_records_every_channel_with_the_runs_total(tmp_path):
    ledger = PrivacyLedger(tmp_path, 3)
    total = compose([QUIET, RELEASE], 1e-3, "rdp")
    assert ledger.record(RUN_ID, SPLIT, [QUIET, RELEASE]) == {
        "parameters": compose([QUIET], 1e-3, "rdp"), "features": compose([RELEASE], 1e-3, "rdp"), "total": total}
    data = ledger_json(ledger)
    assert data["terms"] == {"declared_epsilon": 3.0, "delta": 1e-3, "accountant": "rdp", "feature_share": 0.5}
    assert data["entries"] == chained([
        {"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 0.25, "steps": 4, "channel": "parameters"},
         "delta": 1e-3, "epsilon_after": total},
        {"spend": {"round": 1, "noise_multiplier": 3.0, "sample_rate": 1.0, "steps": 1, "channel": "features"},
         "delta": 1e-3, "epsilon_after": total}], SPLIT, partition=3)
    assert ledger.read(RUN_ID) == (SPLIT, [QUIET, RELEASE])


def test_record_adds_to_what_is_there_and_returns_the_runs_total(tmp_path):
    ledger = PrivacyLedger(tmp_path, 0)
    ledger.record(RUN_ID, TERMS, [QUIET])
    assert ledger.record(RUN_ID, TERMS, [QUIET]) == spent([QUIET, QUIET])
    assert ledger.record(RUN_ID, TERMS, []) == spent([QUIET, QUIET])  # nothing new: the total
    assert [e["spend"]["round"] for e in ledger_json(ledger)["entries"]] == [1, 1]
    split = PrivacyLedger(tmp_path / "split", 0)
    split.record(RUN_ID, SPLIT, [QUIET, RELEASE])
    assert split.record(RUN_ID, SPLIT, [RELEASE]) == spent([QUIET, RELEASE, RELEASE], SPLIT)


def test_a_round_that_applied_no_step_spends_nothing(tmp_path):
    assert PrivacyLedger(tmp_path, 0).record(RUN_ID, TERMS, []) == {"parameters": 0.0, "total": 0.0}
    assert PrivacyLedger(tmp_path, 0).record(RUN_ID, SPLIT, []) == {"parameters": 0.0, "features": 0.0, "total": 0.0}


def test_resent_rounds_are_counted_by_round(tmp_path):
    ledger = PrivacyLedger(tmp_path, 0)
    assert ledger.times_spent(RUN_ID, 1) == 0
    ledger.record(RUN_ID, TERMS, [QUIET, Spend(2, 2.0, 0.25, 4), QUIET])
    assert [ledger.times_spent(RUN_ID, r) for r in (1, 2, 3)] == [2, 1, 0]


def test_a_round_is_spent_once_whatever_its_channels(tmp_path):
    """The feature release of a round is not a re-sent round (which would draw other noise)."""
    ledger = PrivacyLedger(tmp_path, 0)
    ledger.record(RUN_ID, SPLIT, [QUIET, RELEASE])
    assert ledger.times_spent(RUN_ID, 1) == 1


def test_a_run_never_trained_with_dp_has_no_terms_and_no_spend(tmp_path):
    assert PrivacyLedger(tmp_path / "absent", 0).read(RUN_ID) == (None, [])


def test_ledger_directory_may_be_given_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert PrivacyLedger("~/ledger", 0).path(RUN_ID) == tmp_path / "ledger" / f"{RUN_ID}-client-00.json"


@pytest.mark.parametrize("run_id", [RUN_ID + "0", RUN_ID.upper(), RUN_ID[:-1] + "/", "0" + RUN_ID[:-1] + "\n", 7])
def test_run_id_that_is_not_32_hex_digits_is_refused(tmp_path, run_id):
    with pytest.raises(PrivacyBudgetError, match=r"^the server sent run id .* not a 32-digit hex id: refused$"):
        PrivacyLedger(tmp_path, 0).path(run_id)


@pytest.mark.parametrize("max_epsilon", [-1.0, math.nan, math.inf])
def test_node_ceiling_must_be_a_finite_number_not_below_zero(tmp_path, max_epsilon):
    with pytest.raises(LedgerError, match=rf"^max-epsilon must be a finite number >= 0 \(0: no node ceiling\), "
                                          rf"got {max_epsilon}$"):
        PrivacyLedger(tmp_path, 0, max_epsilon)


# --- a damaged or foreign file is never a fresh budget ----------------------------------------------------------

def damaged(ledger):
    return pytest.raises(LedgerError, match=rf"^privacy ledger {ledger.path(RUN_ID)} is damaged \(.*\): restore it "
                                            "from a backup; a missing record would give this run a fresh budget, so "
                                            "the node refuses to train$")


@pytest.mark.parametrize("changes", [
    {"format": "other"}, {"run_id": "0" * 32}, {"partition": 1},
    {"terms": {"declared_epsilon": 0.0, "delta": 1e-3, "accountant": "rdp"}},
    {"terms": {"declared_epsilon": math.inf, "delta": 1e-3, "accountant": "rdp"}},
    {"terms": {"declared_epsilon": 3, "delta": 1e-3, "accountant": "rdp"}},
    {"terms": {"declared_epsilon": 3.0, "delta": 0.0, "accountant": "rdp"}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1.0, "accountant": "rdp"}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1, "accountant": "rdp"}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1e-3, "accountant": "gdp"}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1e-3}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1e-3, "accountant": "rdp", "feature_share": 1.0}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1e-3, "accountant": "rdp", "feature_share": -0.1}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1e-3, "accountant": "rdp", "feature_share": 0}},
    {"terms": {"declared_epsilon": 3.0, "delta": 1e-3, "accountant": "rdp", "feature_share": math.nan}},
    {"entries": [{"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 0.25, "steps": 4,
                            "channel": "labels"}}]},
    {"entries": [{"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 0.25, "steps": -1}}]},
    {"entries": [{"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 0.25, "steps": 4.0}}]},
    {"entries": [{"spend": {"round": 1.0, "noise_multiplier": 2.0, "sample_rate": 0.25, "steps": 4}}]},
    {"entries": [{"spend": {"round": 1, "noise_multiplier": -2.0, "sample_rate": 0.25, "steps": 4}}]},
    {"entries": [{"spend": {"round": 1, "noise_multiplier": math.nan, "sample_rate": 0.25, "steps": 4}}]},
    {"entries": [{"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 0.0, "steps": 4}}]},
    {"entries": [{"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 1.5, "steps": 4}}]},
    {"entries": [{"round": 1}]}, {"entries": {"spend": 1}},
])
def test_hand_edited_ledger_is_refused_naming_the_file(tmp_path, changes):
    ledger = PrivacyLedger(tmp_path, 0)
    write_ledger(ledger, **changes)
    with damaged(ledger):
        ledger.read(RUN_ID)
    with damaged(ledger):  # recording on top of it would hide the damage
        ledger.record(RUN_ID, TERMS, [QUIET])


def test_damage_names_the_bad_terms_or_entry(tmp_path):
    ledger = PrivacyLedger(tmp_path / "foreign", 0)
    write_ledger(ledger, partition=1)
    with pytest.raises(LedgerError, match=r"is damaged \(not this node's ledger of this run\): restore"):
        ledger.read(RUN_ID)
    ledger = PrivacyLedger(tmp_path, 0)
    write_ledger(ledger, terms={"declared_epsilon": 0.0, "delta": 1e-3, "accountant": "rdp"})
    with pytest.raises(LedgerError, match=r"is damaged \(terms \{'declared_epsilon': 0.0, 'delta': 0.001, "
                                          r"'accountant': 'rdp', 'feature_share': 0.0\} are not DP-SGD terms\)"):
        ledger.read(RUN_ID)
    ledger = PrivacyLedger(tmp_path / "other", 0)
    write_ledger(ledger, entries=[{"spend": {"round": 1, "noise_multiplier": 2.0, "sample_rate": 0.0, "steps": 4}}])
    with pytest.raises(LedgerError, match=r"is damaged \(entry \{'round': 1, 'noise_multiplier': 2.0, "
                                          r"'sample_rate': 0.0, 'steps': 4, 'channel': 'parameters'\} is not a "
                                          r"DP-SGD spend\)"):
        ledger.read(RUN_ID)


def test_ledger_of_a_strict_prv_run_reads_back(tmp_path):
    """A budget below 1 and the PRV accountant are valid terms, not damage."""
    ledger = PrivacyLedger(tmp_path, 0)
    strict = Terms(0.5, 1e-5, "prv")
    ledger.record(RUN_ID, strict, [Spend(1, 8.0, 0.25, 1)])
    assert ledger.read(RUN_ID) == (strict, [Spend(1, 8.0, 0.25, 1)])


@pytest.mark.parametrize("content", [b"", b"[1, 2]", b'{"format": "eftguard-privacy-ledger"', b"\xff"])
def test_torn_or_foreign_ledger_bytes_are_refused(tmp_path, content):
    ledger = PrivacyLedger(tmp_path, 0)
    ledger.path(RUN_ID).write_bytes(content)
    with damaged(ledger):
        ledger.read(RUN_ID)


def test_limits_of_a_valid_spend_are_accepted(tmp_path):
    """Zero steps, zero noise (spends infinity), sampling everything and an entry without a channel (parameters) are
    records, not damage."""
    ledger = PrivacyLedger(tmp_path, 0)
    edge = [Spend(1, 2.0, 1.0, 0), Spend(2, 0.0, 0.25, 4)]
    entries = chained([{"spend": {"round": s.round, "noise_multiplier": s.noise_multiplier,
                                  "sample_rate": s.sample_rate, "steps": s.steps}} for s in edge])
    ledger.path(RUN_ID).write_text(json.dumps({"format": "eftguard-privacy-ledger", "format_version": 2,
                                               "run_id": RUN_ID, "partition": 0, "terms": TERMS.__dict__,
                                               "entries": entries}))
    assert ledger.read(RUN_ID) == (TERMS, edge)
    assert ledger.record(RUN_ID, TERMS, [QUIET]) == {"parameters": math.inf, "total": math.inf}
    split = PrivacyLedger(tmp_path / "split", 0)
    split.record(RUN_ID, SPLIT, [Spend(1, 2.0, 0.25, 4, "features"), Spend(1, 0.0, 1.0, 1, "features")])
    assert split.record(RUN_ID, SPLIT, []) == {"parameters": 0.0, "features": math.inf, "total": math.inf}


# --- a shortened history is refused (issue 34, item 3) ------------------------------------------------------

def three_rounds(tmp_path):
    ledger = PrivacyLedger(tmp_path, 0)
    for number in (1, 2, 3):
        ledger.record(RUN_ID, TERMS, [Spend(number, 8.0, 0.25, 4)])
    return ledger


def rewrite(ledger, entries):
    """A hand edit that keeps the file well formed and its hash chain intact (anyone can recompute it)."""
    data = ledger_json(ledger)
    data["entries"] = chained([{k: v for k, v in e.items() if k != "previous"} for e in entries])
    ledger.path(RUN_ID).write_text(json.dumps(data))


@pytest.mark.parametrize("edit", ["drop the last round", "drop the first round", "lower a round's steps"])
def test_a_shortened_or_edited_history_is_refused_even_with_its_hash_chain_recomputed(tmp_path, edit):
    ledger = three_rounds(tmp_path)
    entries = ledger_json(ledger)["entries"]
    if edit == "drop the last round":
        entries = entries[:-1]
    elif edit == "drop the first round":
        entries = entries[1:]
    else:
        entries[0]["spend"]["steps"] = 1
    rewrite(ledger, entries)
    with pytest.raises(LedgerError, match=r"is damaged \(its mark .* records 3 spends that the file no longer holds "
                                          r"as written\)"):
        ledger.read(RUN_ID)
    with pytest.raises(LedgerError):  # and the node does not train on it
        ledger.authorize(RUN_ID, 4, TERMS, [Spend(4, 8.0, 0.25, 4)])


def test_an_entry_edited_without_its_chain_is_refused(tmp_path):
    ledger = three_rounds(tmp_path)
    data = ledger_json(ledger)
    data["entries"][1]["spend"]["noise_multiplier"] = 80.0
    ledger.path(RUN_ID).write_text(json.dumps(data))
    with pytest.raises(LedgerError, match=r"entry 2 does not follow the one before it \(hash chain broken\)"):
        ledger.read(RUN_ID)


def test_a_deleted_ledger_is_refused_while_its_mark_remains(tmp_path):
    ledger = three_rounds(tmp_path)
    ledger.path(RUN_ID).unlink()
    with pytest.raises(LedgerError, match=rf"^privacy ledger {re.escape(str(ledger.path(RUN_ID)))} is missing, but "
                                          r"its mark .* records 3 spends in this run: restore the ledger"):
        ledger.authorize(RUN_ID, 4, TERMS, [Spend(4, 8.0, 0.25, 4)])


def test_a_ledger_ahead_of_its_mark_reads_a_crash_between_the_two_writes(tmp_path):
    """The ledger is written before its mark: a crash in between leaves the ledger ahead, which must read (the
    crash over-counts, never under-counts), and the next record brings the mark up."""
    ledger = three_rounds(tmp_path)
    mark = ledger.mark_path(RUN_ID).read_text()
    ledger.record(RUN_ID, TERMS, [Spend(4, 8.0, 0.25, 4)])
    ledger.mark_path(RUN_ID).write_text(mark)  # the mark of three rounds beside a ledger of four
    assert len(ledger.read(RUN_ID)[1]) == 4
    ledger.record(RUN_ID, TERMS, [Spend(5, 8.0, 0.25, 4)])
    assert json.loads(ledger.mark_path(RUN_ID).read_text())["entries"] == 5


def test_a_lost_mark_is_rewritten_from_the_ledger_and_a_damaged_one_is_refused(tmp_path):
    ledger = three_rounds(tmp_path)
    ledger.mark_path(RUN_ID).unlink()
    assert len(ledger.read(RUN_ID)[1]) == 3
    ledger.record(RUN_ID, TERMS, [Spend(4, 8.0, 0.25, 4)])
    assert json.loads(ledger.mark_path(RUN_ID).read_text())["entries"] == 4
    ledger.mark_path(RUN_ID).write_text("{")
    with pytest.raises(LedgerError, match=r"^privacy ledger mark .* is damaged"):
        ledger.read(RUN_ID)


def test_two_ledger_folders_keep_their_own_marks(tmp_path):
    """Two nodes on one host (or two tests) with the same run id and partition in different folders."""
    first, second = three_rounds(tmp_path / "a"), PrivacyLedger(tmp_path / "b", 0)
    assert first.mark_path(RUN_ID) != second.mark_path(RUN_ID)
    assert second.read(RUN_ID) == (None, [])


def test_a_ledger_written_before_the_hash_chain_is_refused_not_trusted(tmp_path):
    ledger = PrivacyLedger(tmp_path, 0)
    ledger.record(RUN_ID, TERMS, [QUIET])
    data = ledger_json(ledger)
    data["format_version"] = 1
    for entry in data["entries"]:
        del entry["previous"]
    ledger.path(RUN_ID).write_text(json.dumps(data))
    with pytest.raises(LedgerError, match=r"format version 1, not 2 \(hash-chained\)"):
        ledger.read(RUN_ID)


# --- authorising a round ----------------------------------------------------------------------------------------

def test_round_without_dp_is_allowed_for_a_node_without_ceiling_and_a_run_without_dp_history(tmp_path):
    assert PrivacyLedger(tmp_path, 0).authorize(RUN_ID, 1, None, None) is None


def test_round_without_dp_is_refused_once_the_run_is_known_as_dp(tmp_path):
    ledger = PrivacyLedger(tmp_path, 0)
    ledger.record(RUN_ID, TERMS, [QUIET])
    with pytest.raises(PrivacyBudgetError, match=rf"^the server asks for round 2 without DP-SGD, but this node's "
                                                  rf"ledger knows run {RUN_ID} as a DP run \(epsilon 3.0\): refused$"):
        ledger.authorize(RUN_ID, 2, None, None)


def test_node_with_a_ceiling_refuses_every_round_without_dp(tmp_path):
    with pytest.raises(PrivacyBudgetError, match=r"^the server asks for a round without DP-SGD and this node's "
                                                 r"--max-epsilon is 5.0: refused$"):
        PrivacyLedger(tmp_path, 0, 5.0).authorize(RUN_ID, 1, None, None)


def over_budget(round_number, planned, spent, budget, recorded, ledger):
    """The refusal: the total, both channels composed, above the budget."""
    sigmas = ", ".join(f"{p.noise_multiplier:.4f} ({p.channel})" for p in planned)
    return re.escape(f"round {round_number} with noise multiplier {sigmas} would bring this node's recorded spend "
                     f"in run {RUN_ID} to epsilon {spent['total']:.3f} > its budget {budget:g} ({recorded} rounds "
                     f"recorded in {ledger.path(RUN_ID)}): refused")


def test_round_spending_exactly_the_budget_is_allowed_and_any_more_is_refused(tmp_path):
    exact = Terms(compose([QUIET, QUIET], 1e-3, "rdp"), 1e-3, "rdp")
    ledger = PrivacyLedger(tmp_path, 0)
    assert ledger.authorize(RUN_ID, 1, exact, [QUIET]) == exact
    ledger.record(RUN_ID, exact, [QUIET])
    assert ledger.authorize(RUN_ID, 2, exact, [Spend(2, 2.0, 0.25, 4)]) == exact
    more = [Spend(2, 2.0, 0.25, 5)]
    refusal = over_budget(2, more, spent([QUIET] + more), exact.declared_epsilon, 1, ledger)
    with pytest.raises(PrivacyBudgetError, match=rf"^{refusal}$"):
        ledger.authorize(RUN_ID, 2, exact, more)


def test_the_budget_is_the_composed_total_whatever_the_split_between_channels(tmp_path):
    """Two rounds spending nearly everything on one channel and little on the other fit while their composition
    does; one step more on the loud channel does not."""
    loud, faint = Spend(1, 2.0, 0.25, 4), Spend(1, 12.0, 1.0, 1, "features")
    exact = Terms(compose([loud, faint, loud, faint], 1e-3, "rdp"), 1e-3, "rdp", 0.5)
    ledger = PrivacyLedger(tmp_path, 0)
    assert ledger.authorize(RUN_ID, 1, exact, [loud, faint]) == exact
    ledger.record(RUN_ID, exact, [loud, faint])
    second = [Spend(2, 2.0, 0.25, 4), Spend(2, 12.0, 1.0, 1, "features")]
    assert ledger.authorize(RUN_ID, 2, exact, second) == exact
    more = [Spend(2, 2.0, 0.25, 5), second[1]]
    refusal = over_budget(2, more, spent([loud, faint] + more, exact), exact.declared_epsilon, 1, ledger)
    with pytest.raises(PrivacyBudgetError, match=rf"^{refusal}$"):
        ledger.authorize(RUN_ID, 2, exact, more)


def test_first_round_over_the_declared_budget_is_refused(tmp_path):
    with pytest.raises(PrivacyBudgetError, match=r"to epsilon 3.171 > its budget 3 \(0 rounds recorded"):
        PrivacyLedger(tmp_path, 0).authorize(RUN_ID, 1, TERMS, [ROUND_1])


def test_the_first_rounds_terms_bind_the_run_whatever_the_server_asks_later(tmp_path):
    """Raising dp_eps, a looser delta, another accountant or another feature share later does not buy more
    rounds."""
    ledger = PrivacyLedger(tmp_path, 0)
    ledger.record(RUN_ID, TERMS, [QUIET])
    later = [Spend(2, 1.0, 0.25, 4)]
    looser = [Terms(30.0, 1e-3, "rdp"), Terms(3.0, 0.2, "rdp"), Terms(3.0, 1e-3, "prv")]
    assert [compose([QUIET] + later, t.delta, t.accountant) < 3.0 for t in looser] == [False, True, True]
    for requested in looser:
        with pytest.raises(PrivacyBudgetError, match=r"> its budget 3 \(1 rounds recorded"):
            ledger.authorize(RUN_ID, 2, requested, later)
    with pytest.raises(PrivacyBudgetError, match=rf"^the server asks for feature share 0.5, but run {RUN_ID} began "
                                                  rf"with 0.0: refused$"):
        ledger.authorize(RUN_ID, 2, SPLIT, [Spend(2, 2.0, 0.25, 4), Spend(2, 3.0, 1.0, 1, "features")])
    assert ledger.authorize(RUN_ID, 2, Terms(30.0, 0.2, "prv"), [QUIET]) == TERMS


@pytest.mark.parametrize("ceiling, budget", [(1.0, "1"), (5.0, "3")])
def test_budget_is_the_lower_of_the_nodes_ceiling_and_the_declared_epsilon(tmp_path, ceiling, budget):
    with pytest.raises(PrivacyBudgetError, match=rf"> its budget {budget} "):
        PrivacyLedger(tmp_path, 0, ceiling).authorize(RUN_ID, 1, TERMS, [ROUND_1])
    assert PrivacyLedger(tmp_path, 0, 5.0).authorize(RUN_ID, 1, TERMS, [QUIET]) == TERMS


def test_refused_round_leaves_no_ledger_file(tmp_path):
    ledger = PrivacyLedger(tmp_path, 0)
    with pytest.raises(PrivacyBudgetError):
        ledger.authorize(RUN_ID, 1, TERMS, [ROUND_1])
    assert not ledger.path(RUN_ID).exists()


# --- the lock ---------------------------------------------------------------------------------------------------

def test_the_lock_excludes_every_other_holder_until_released(tmp_path):
    """Two rounds of one run on one node (two processes, or a resent round) cannot both pass the budget check."""
    ledger = PrivacyLedger(tmp_path / "new" / "ledger", 0)
    lock_file = tmp_path / "new" / "ledger" / f".{RUN_ID}-client-00.json.lock"
    for _ in range(2):  # the second time the folder exists already
        with ledger.locked(RUN_ID), open(lock_file) as other:
            for mode in (fcntl.LOCK_EX, fcntl.LOCK_SH):
                with pytest.raises(BlockingIOError):
                    fcntl.flock(other, mode | fcntl.LOCK_NB)
        with open(lock_file) as other:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
