"""The node's privacy ledger, tried as a curious or malicious server would: through the real ClientApp over the
in-process grid, with settings the server chose. The node refuses, and its ledger file shows the true spend.

Then the ledger called directly (no round, no grid; the second half of the file): each test is a way a node could
over- or under-count what it spent, or trust a file it should not. Fast enough for the mutation check of
defenses/ledger.py (docs/mutation.md)."""

import fcntl
import functools
import hashlib
import json
import math
import re

import numpy as np
import pytest
from flwr.app import Message, MessageType, RecordDict

from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition
from eftguard.defenses.dp import PrivacyBudgetError
from eftguard.defenses.ledger import LedgerError, PrivacyLedger, Spend, Terms, compose
from eftguard.federation.client import dp_budget
from eftguard.federation.records import ClientSettings, to_record
from eftguard.federation.server import run_server
from eftguard.model import build_model
from eftguard.rundir import RunDirectory, RunError
from conftest import MICRO_PRESET
from fakegrid import FakeGrid

# micro_preset: the ledger's subject is the accounting, not the model
pytestmark = pytest.mark.usefixtures("micro_preset", "task_identity_set")

RUN_ID = "feedfacecafebeef0123456789abcdef"
# Two clients, both in both rounds; client 0 holds about half of 64 images: 2 DP-SGD steps per round. Resolved
# where used: the micro preset exists only while the tests run.
CFG = TrainConfig(model=MICRO_PRESET, clients=2, clients_per_round=2, rounds=2, train_samples=64, test_samples=20,
                  batch_size=16, dp_eps=3.0, accountant="rdp")


@pytest.fixture(scope="module")
def honest(micro_preset):
    """(client 0's sample count, its noise multiplier for the run's two rounds, the start model record)."""
    n = len(client_partition("photos", "", CFG.model, CFG.train_samples, CFG.seed, CFG.clients, CFG.beta)[0])
    model = build_model(CFG.model, 10, CFG.local_layers, seed=0)
    return n, dp_budget(CFG, 0, n, CFG.rounds).noise_multiplier, to_record(model.state_dict())


@functools.lru_cache
def honest_feature_noise(dp_eps: float) -> float:
    """The feature channel's noise an honest server sends client 0 for CFG with dp_eps (0 without DP)."""
    if not 0 < dp_eps < math.inf:
        return 0.0
    cfg = TrainConfig(**{**CFG.__dict__, "dp_eps": dp_eps})
    n = len(client_partition("photos", "", cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.beta)[0])
    return dp_budget(cfg, 0, n, cfg.rounds).feature_noise_multiplier


class MaliciousServer:
    """Sends client 0 (node 100) whatever train settings it likes, for one run id."""

    def __init__(self, model_record, ledger_dir, run_id=RUN_ID, **node_config):
        self.model_record, self.run_id = model_record, run_id
        self.grid = FakeGrid(2, node_config={"ledger-dir": str(ledger_dir), **node_config})

    def train(self, round_number, sigma, **changes):
        """A round with DP-SGD noise sigma; the feature channel gets the noise calibrated for the settings."""
        cfg = TrainConfig(**{**CFG.__dict__, **changes})
        settings = ClientSettings.from_config(cfg, round_number, sigma, self.run_id,
                                              honest_feature_noise(cfg.dp_eps)).to_record()
        msg = Message(RecordDict({"model": self.model_record, "settings": settings}), 100, MessageType.TRAIN)
        (reply,) = self.grid.send_and_receive([msg])
        return reply


def ledger_file(ledger_dir, run_id=RUN_ID, partition=0):
    return json.loads((ledger_dir / f"{run_id}-client-{partition:02d}.json").read_text())


def recorded_rounds(record):
    """The rounds a ledger file records, once per round (each DP round records both channels)."""
    rounds = [e["spend"]["round"] for e in record["entries"]]
    assert rounds[::2] == rounds[1::2] and [e["spend"]["channel"] for e in record["entries"]] == [
        "parameters", "features"] * (len(rounds) // 2)
    return rounds[::2]


def refused(reply, reason):
    assert reply.has_error(), "the client trained"
    assert "client refuses" in reply.error.reason and reason in reply.error.reason, reply.error.reason
    return True


def test_resent_round_is_spent_again_with_fresh_noise(honest, tmp_path):
    n, sigma, model = honest
    server = MaliciousServer(model, tmp_path)
    first, again = server.train(1, sigma), server.train(1, sigma)  # the same round, the same settings
    assert not first.has_error() and not again.has_error()
    key = "head.weight"
    assert not np.array_equal(first.content["update"][key].numpy(), again.content["update"][key].numpy())
    # fresh masks (and batches), not a second noisy copy of the same sums: the ledger composes independent rounds
    assert not np.array_equal(first.content["truth"]["kept_ids"].numpy(), again.content["truth"]["kept_ids"].numpy())
    assert refused(server.train(2, sigma), "its budget 3")  # the re-sent round used round 2's budget
    record = ledger_file(tmp_path)
    steps = math.ceil(n / CFG.batch_size)
    assert [e["spend"] for e in record["entries"]] == [
        {"round": 1, "noise_multiplier": sigma, "sample_rate": pytest.approx(CFG.batch_size / n), "steps": steps,
         "channel": "parameters"},
        {"round": 1, "noise_multiplier": honest_feature_noise(CFG.dp_eps), "sample_rate": 1.0, "steps": 1,
         "channel": "features"}] * 2
    spent = record["entries"][-1]["epsilon_after"]
    metrics = again.content["metrics"]
    assert max(metrics["dp-epsilon-parameters"], metrics["dp-epsilon-features"]) < metrics["dp-epsilon-spent"]
    assert metrics["dp-epsilon-spent"] == spent and 0.995 * 3.0 <= spent <= 3.0  # two sends: the run's budget


def test_raising_dp_eps_mid_run_is_refused(honest, tmp_path):
    n, sigma, model = honest
    server = MaliciousServer(model, tmp_path)
    assert not server.train(1, sigma).has_error()
    loose = TrainConfig(**{**CFG.__dict__, "dp_eps": 30.0})
    assert refused(server.train(2, dp_budget(loose, 0, n, 2).noise_multiplier, dp_eps=30.0), "its budget 3")
    record = ledger_file(tmp_path)
    assert record["terms"]["declared_epsilon"] == 3.0 and recorded_rounds(record) == [1]


def test_lowering_the_noise_is_refused(honest, tmp_path):
    _, sigma, model = honest
    server = MaliciousServer(model, tmp_path)
    assert not server.train(1, sigma).has_error()
    assert refused(server.train(2, sigma / 3), "its budget 3")
    assert recorded_rounds(ledger_file(tmp_path)) == [1]


def test_dp_eps_zero_for_a_dp_run_is_refused(honest, tmp_path):
    _, sigma, model = honest
    server = MaliciousServer(model, tmp_path)
    assert not server.train(1, sigma).has_error()
    assert refused(server.train(2, 0.0, dp_eps=0.0), "without DP-SGD")


@pytest.mark.parametrize("changes", [{"dp_eps": math.nan}, {"dp_eps": math.inf}, {"dp_delta": 1.5},
                                     {"max_grad_norm": math.nan}, {"batch_size": 0}, {"accountant": "gdp"}])
def test_invalid_dp_request_is_refused_not_read_as_no_dp(honest, tmp_path, changes):
    _, sigma, model = honest
    assert refused(MaliciousServer(model, tmp_path).train(1, sigma, **changes), "refused")
    assert not list(tmp_path.glob("*.json"))


def test_node_ceiling_caps_the_run_and_refuses_rounds_without_dp(honest, tmp_path):
    _, sigma, model = honest
    server = MaliciousServer(model, tmp_path, **{"max-epsilon": 1.0})
    assert refused(server.train(1, sigma), "its budget 1")  # sigma spends about 2.1 of the server's 3
    assert refused(server.train(1, 0.0, dp_eps=0.0), "--max-epsilon is 1.0")
    assert not list(tmp_path.glob("*.json"))


def test_hostile_run_id_cannot_escape_the_ledger_folder(honest, tmp_path):
    _, sigma, model = honest
    ledger_dir = tmp_path / "ledger"
    assert refused(MaliciousServer(model, ledger_dir, run_id="../" * 4 + "x").train(1, sigma), "not a 32-digit")
    assert list(tmp_path.rglob("*")) == []


def test_torn_ledger_file_is_an_error_naming_it_not_a_fresh_budget(honest, tmp_path):
    _, sigma, model = honest
    server = MaliciousServer(model, tmp_path)
    assert not server.train(1, sigma).has_error()
    path = tmp_path / f"{RUN_ID}-client-00.json"
    torn = path.read_bytes()[:len(path.read_bytes()) // 2]  # power loss mid-write (or a hand edit)
    path.write_bytes(torn)
    assert refused(server.train(2, sigma), f"privacy ledger {path} is damaged")
    assert path.read_bytes() == torn
    path.unlink()
    path.symlink_to("/dev/zero")  # read whole, it would never end: refused, not read
    assert refused(server.train(2, sigma), f"privacy ledger {path} is damaged ({path} is not a regular file)")


def test_deployed_node_without_a_secret_draws_noise_the_server_cannot_regenerate(honest, tmp_path):
    """Without --noise-secret a deployed node seeds from the OS: the same round, settings and seed give other
    noise on every try (with a secret of 0, as simulated nodes use, they would give the same)."""
    _, sigma, model = honest
    a, b = (MaliciousServer(model, tmp_path / name, **{"noise-secret": None}).train(1, sigma) for name in "ab")
    key = "head.weight"
    assert not np.array_equal(a.content["update"][key].numpy(), b.content["update"][key].numpy())


def test_ledger_of_another_run_or_partition_is_not_accepted(tmp_path):
    ledger = PrivacyLedger(tmp_path, 1)
    terms, spend = Terms(3.0, 1e-3, "rdp"), Spend(1, 1.5, 0.25, 4)
    ledger.record(RUN_ID, terms, [spend])
    other = tmp_path / f"{'0' * 32}-client-01.json"
    other.write_text((tmp_path / f"{RUN_ID}-client-01.json").read_text())  # copied over a fresh run's name
    with pytest.raises(LedgerError, match="not this node's ledger of this run"):
        ledger.read("0" * 32)


def test_composition_of_equal_rounds_equals_one_long_run():
    """Merging equal rounds is exact: the client's spend equals the server's single-history computation."""
    from eftguard.defenses.dp import epsilon_spent

    rounds = [Spend(r, 1.1, 0.2, 5) for r in (1, 2, 3)]
    for accountant in ("rdp", "prv"):
        assert compose(rounds, 1e-4, accountant) == epsilon_spent(1.1, 0.2, 15, 1e-4, accountant)
    assert compose(rounds + [Spend(4, 0.0, 0.2, 5)], 1e-4, "rdp") == math.inf
    assert compose([Spend(1, 0.9, 0.2, 5), Spend(2, 1.4, 0.2, 5)], 1e-4, "rdp") > compose(
        [Spend(1, 1.4, 0.2, 10)], 1e-4, "rdp")


# --- the real server over the grid -------------------------------------------------------------------------


def one_round(cfg, tmp_path, **grid):
    run = RunDirectory.create(tmp_path / "run", TrainConfig(**{**cfg.__dict__, "rounds": 1}).resolved())
    run_server(FakeGrid(2, **grid), run.path)
    return run, run.metrics()[0]


def test_node_that_does_not_share_truth_sends_none_and_the_round_goes_on(tmp_path):
    plain = TrainConfig(**{**CFG.__dict__, "dp_eps": 0.0})
    sent = []

    def record(node, reply):
        sent.append("truth" in reply.content) if reply.metadata.message_type == "train" else None
        return reply

    # A deployed node started without --share-truth: the key is absent, sharing is off by default.
    run, metrics = one_round(plain, tmp_path, tamper=record, node_config={"share-truth": None})
    assert sent == [False, False] and metrics["dropped"] == {} and set(metrics["num_examples"]) == {"0", "1"}
    with pytest.raises(RunError, match="client 0 did not share its ground truth"):
        run.load_truth(1, 0)


def test_ground_truth_is_encrypted_at_rest(tmp_path):
    from eftguard.defenses.at_rest import create_key

    create_key(tmp_path / "key")
    cfg = TrainConfig(**{**CFG.__dict__, "dp_eps": 0.0, "encrypt_at_rest": str(tmp_path / "key")})
    run, _ = one_round(cfg, tmp_path)
    stored = run.truth_path(1, 1)
    assert stored.name.endswith(".safetensors.enc") and b"sample_ids" not in stored.read_bytes()
    opened = RunDirectory.open(run.path, tmp_path / "key")
    truth = opened.load_truth(1, 1)
    assert len(truth["sample_ids"]) == len(opened.load_upload(1, 1, "features")["labels"]) > 0
    with pytest.raises(RunError, match="pass --key KEYFILE"):
        RunDirectory.open(run.path).load_truth(1, 1)


def test_server_resuming_after_a_client_trained_resends_the_round_and_the_client_refuses(tmp_path):
    replies = []

    def die_after_client_0_trained_round_2(node, reply):
        if reply.metadata.message_type == "train":
            replies.append(node)
            if len(replies) == 3:  # round 1: nodes 100 and 101; round 2: node 100 has trained and recorded it
                raise KeyboardInterrupt
        return reply

    nodes = {"ledger-dir": str(tmp_path / "nodes")}
    run = RunDirectory.create(tmp_path / "run", CFG.resolved())
    with pytest.raises(KeyboardInterrupt):
        run_server(FakeGrid(2, tamper=die_after_client_0_trained_round_2, node_config=nodes), run.path)
    run_server(FakeGrid(2, node_config=nodes), run.path)
    second = run.metrics()[1]
    assert re.match(r"client failed: client refuses \[epsilon spent in this run: \S+\]: round 2",
                    second["dropped"]["0"])
    assert set(second["epsilon"]) == {"0", "1"} and set(second["epsilon_parameters"]) == {"1"}
    assert recorded_rounds(ledger_file(tmp_path / "nodes", run.run_id, 0)) == [1, 2]
    assert recorded_rounds(ledger_file(tmp_path / "nodes", run.run_id, 1)) == [1, 2]
    for k in (0, 1):  # what each client spent, recomputed independently from its ledger's record of what it applied
        record = ledger_file(tmp_path / "nodes", run.run_id, k)
        truth = independent_epsilon(record)
        assert record["entries"][-1]["epsilon_after"] == pytest.approx(truth, rel=0.01) and truth <= 3.0 * 1.002
        reported = [r["epsilon"][str(k)] for r in run.metrics() if str(k) in r["epsilon"]]
        assert reported[-1] == record["entries"][-1]["epsilon_after"]  # client 0's with its refusal: the truth


def independent_epsilon(record) -> float:
    """Google's dp-accounting over a ledger file's entries, with the kind of accountant the run's terms name (its
    PLD accountant for prv, its RDP accountant for rdp, an implementation apart from opacus'): every recorded spend
    composed at the run's delta, feature releases as Gaussian mechanisms, DP-SGD as Poisson-subsampled ones."""
    import logging

    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    logging.getLogger("absl").setLevel(logging.ERROR)  # RDP orders it drops, noisily
    kind = record["terms"]["accountant"]
    accountant = pld_privacy_accountant.PLDAccountant() if kind == "prv" else rdp_privacy_accountant.RdpAccountant()
    for entry in record["entries"]:
        spend = entry["spend"]
        gaussian = dp_accounting.GaussianDpEvent(spend["noise_multiplier"])
        event = gaussian if spend["sample_rate"] == 1.0 else dp_accounting.PoissonSampledDpEvent(
            spend["sample_rate"], gaussian)
        accountant.compose(event, spend["steps"])
    return accountant.get_epsilon(record["terms"]["delta"])


def test_a_ledger_shortened_between_rounds_is_refused_and_no_reported_epsilon_falls_below_the_truth(tmp_path,
                                                                                                  monkeypatch):
    """Issue 34, item 3: the run stops after round 1; client 0's recorded round is deleted from its ledger (the file
    rewritten well formed, its hash chain recomputed); the run resumes. Client 0 refuses to train on a history
    shorter than what it already sent (its high-water mark, kept outside the run directory), so it spends
    nothing more, and no epsilon the run reports for it is below what it really spent."""
    from eftguard.federation import server

    real_exchange = server.exchange

    def stop_before_round_2(grid, messages, *args):
        if any(msg.content["settings"]["round"] == 2 for msg in messages.values()):
            raise KeyboardInterrupt
        return real_exchange(grid, messages, *args)

    nodes = {"ledger-dir": str(tmp_path / "nodes")}
    run = RunDirectory.create(tmp_path / "run", CFG.resolved())
    monkeypatch.setattr(server, "exchange", stop_before_round_2)
    with pytest.raises(KeyboardInterrupt):
        run_server(FakeGrid(2, node_config=nodes), run.path)
    monkeypatch.setattr(server, "exchange", real_exchange)
    path = tmp_path / "nodes" / f"{run.run_id}-client-00.json"
    truth = independent_epsilon(json.loads(path.read_text()))
    forged = json.loads(path.read_text())
    forged["entries"] = []  # nothing spent, as far as the file says
    path.write_text(json.dumps(forged))
    run_server(FakeGrid(2, node_config=nodes), run.path)
    second = run.metrics()[1]
    assert "privacy ledger" in second["dropped"]["0"] and "its mark" in second["dropped"]["0"]
    assert set(second["epsilon"]) == {"1"}  # a damaged ledger tells nothing; round 1's report stands
    reported = [r["epsilon"]["0"] for r in run.metrics() if "0" in (r["epsilon"] or {})]
    assert reported and max(reported) == pytest.approx(truth, rel=0.01)


def switch_off_dp(node, reply):
    """Client 0's DP-SGD was switched off (the `dp = None` bug): its reply reports no DP."""
    if node == 100 and reply.metadata.message_type == "train":
        metrics = reply.content["metrics"]
        for key in [k for k in metrics if k.startswith("dp-")]:
            del metrics[key]
    return reply


def test_dp_run_records_the_clients_own_spend_and_drops_a_client_without_dp(tmp_path):
    run, metrics = one_round(CFG, tmp_path, tamper=switch_off_dp, node_config={"ledger-dir": str(tmp_path / "nodes")})
    assert "does not report what it applied" in metrics["dropped"]["0"] and not run.upload_dir(1, 0).exists()
    spent = ledger_file(tmp_path / "nodes", run.run_id, 1)["entries"][-1]["epsilon_after"]
    assert metrics["epsilon"] == {"1": spent} and 0 < spent < CFG.dp_eps  # one of two calibrated rounds
    assert metrics["epsilon_server"]["1"] == pytest.approx(spent, rel=1e-9)


@pytest.mark.parametrize("lie, reason", [
    ({"dp-noise-multiplier": 0.5}, "below the 1.0000 sent"), ({"dp-noise-multiplier": math.nan}, "below"),
    ({"dp-steps": 3}, "3 DP-SGD steps"), ({"dp-steps": True}, "DP-SGD steps"), ({"dp-sample-rate": 0.9}, "schedule"),
    ({"dp-epsilon-spent": math.nan}, "outside"), ({"dp-epsilon-spent": 0.0}, "outside"),
    ({"dp-epsilon-spent": 3.5}, "outside"), ({"dp-steps": "4"}, "DP-SGD steps"),
    ({"dp-noise-multiplier": "abc"}, "does not report"),
    ({"dp-feature-noise-multiplier": 1.5}, "feature noise multiplier 1.5, below the 2.0000 sent"),
    ({"dp-epsilon-features": 3.5}, "outside"), ({"dp-epsilon-parameters": math.nan}, "outside"),
    ({"dp-epsilon-features": "1.3x"}, "does not report"),
])
def test_dp_report_that_claims_less_than_the_run_is_dropped(lie, reason):
    from flwr.app import ConfigRecord

    from eftguard.defenses.dp import client_budget
    from eftguard.federation.records import UploadError
    from eftguard.federation.server import check_dp_report

    budget = client_budget(3.0, 1e-3, "rdp", 64, 16, 1, (1,), noise_multiplier=1.0, feature_share=0.5,
                           feature_noise_multiplier=2.0)
    honest_report = {"dp-noise-multiplier": 1.0, "dp-sample-rate": 0.25, "dp-steps": 4, "dp-epsilon-spent": 2.0,
                     "dp-epsilon-parameters": 1.4, "dp-feature-noise-multiplier": 2.0, "dp-epsilon-features": 1.3}
    assert check_dp_report(ConfigRecord(honest_report), budget, 3.0) == {"total": 2.0, "parameters": 1.4,
                                                                         "features": 1.3}
    with pytest.raises(UploadError, match=reason):
        check_dp_report(ConfigRecord({**honest_report, **lie}), budget, 3.0)


def test_non_dp_run_never_records_an_epsilon(tmp_path):
    def claim_dp(node, reply):
        if reply.metadata.message_type == "train":
            assert not any(k.startswith("dp-") for k in reply.content["metrics"])  # the client applied none
            reply.content["metrics"]["dp-epsilon-spent"] = 0.5
        return reply

    _, metrics = one_round(TrainConfig(**{**CFG.__dict__, "dp_eps": 0.0}), tmp_path, tamper=claim_dp)
    assert metrics["epsilon"] is None and metrics["epsilon_server"] is None and metrics["dropped"] == {}


def test_run_directory_with_nan_dp_eps_is_refused_before_any_round(tmp_path):
    """config.toml edited to dp_eps = nan: the server would calibrate noise the clients skip."""
    run = RunDirectory.create(tmp_path / "run", TrainConfig(**{**CFG.__dict__, "dp_eps": 0.0}).resolved())
    text = (run.path / "config.toml").read_text().replace("dp_eps = 0.0", "dp_eps = nan")
    (run.path / "config.toml").write_text(text)
    from eftguard.errors import ConfigError
    with pytest.raises(ConfigError, match="--dp-eps must be a finite number"):
        run_server(FakeGrid(2), run.path)
    assert run.metrics() == []


# --- the ledger called directly: no round, no grid ----------------------------------------------------------------

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


def chained(entries, terms=TERMS, partition=0, first=None):
    """Ledger entries as a node writes them: each names the sha256 of the one before (of its sorted JSON), the
    first the sha256 of [run id, partition, terms] (written out here, independently of the ledger's helpers), or
    `first` where given."""
    previous = first or sha256_of([RUN_ID, partition, {"declared_epsilon": terms.declared_epsilon,
                                                       "delta": terms.delta, "accountant": terms.accountant,
                                                       "feature_share": terms.feature_share}])
    out = []
    for entry in entries:
        out.append({**entry, "previous": previous})
        previous = sha256_of(out[-1])
    return out


def ledger_json(ledger, run_id=RUN_ID):
    return json.loads(ledger.path(run_id).read_text())


def write_ledger(ledger, **changes):
    """A ledger file as _write would leave it after one QUIET round, with some fields changed by an editor who knows
    the format: the hash chain recomputed for the new terms and entries (anyone can), the mark removed (a lost mark
    is rewritten from the ledger). Only the check of the changed field itself can then refuse it."""
    ledger.record(RUN_ID, TERMS, [QUIET])
    data = {**ledger_json(ledger), **changes}
    terms, entries = data["terms"], data["entries"]
    if {"terms", "entries"} & changes.keys() and isinstance(entries, list) and all(isinstance(e, dict) for e in entries):
        start = {"declared_epsilon": terms.get("declared_epsilon"), "delta": terms.get("delta"),
                 "accountant": terms.get("accountant"), "feature_share": terms.get("feature_share", 0.0)}
        data["entries"] = chained([{k: v for k, v in e.items() if k != "previous"} for e in entries],
                                  first=sha256_of([RUN_ID, ledger.partition, start]))
    ledger.path(RUN_ID).write_text(json.dumps(data))
    ledger.mark_path(RUN_ID).unlink()


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
                                          rf"its mark {re.escape(str(ledger.mark_path(RUN_ID)))} records 3 spends in "
                                          r"this run: restore the ledger from a backup; a missing record would give "
                                          r"this run a fresh budget, so the node refuses to train$"):
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


@pytest.mark.parametrize("edit", [{"format": "other"}, {"run_id": "0" * 32}, {"partition": 1}, {"entries": -1},
                                  {"entries": "3"}, {"head": None}])
def test_a_mark_of_another_run_or_node_or_out_of_shape_is_refused(tmp_path, edit):
    """Each field alone: a mark copied from another run or node, or edited, is not this ledger's high-water mark."""
    ledger = three_rounds(tmp_path)
    ledger.mark_path(RUN_ID).write_text(json.dumps({**json.loads(ledger.mark_path(RUN_ID).read_text()), **edit}))
    with pytest.raises(LedgerError, match=rf"^privacy ledger mark {re.escape(str(ledger.mark_path(RUN_ID)))} is "
                                          r"damaged \(not this node's mark of this run\): restore it, or the ledger "
                                          r"cannot be checked against it and the node refuses to train$"):
        ledger.read(RUN_ID)


def test_marks_live_in_eftguard_home_or_the_given_folder_keyed_by_the_ledger_folder(tmp_path, monkeypatch):
    """A node finds the marks it wrote before an upgrade only if this layout stays: a mark not found reads as a
    fresh run, so a deleted ledger would go unnoticed. $EFTGUARD_HOME, else ~/.eftguard, else the folder given."""
    folder = hashlib.sha256(str((tmp_path / "ledgers").resolve()).encode()).hexdigest()[:16]
    name = f"{RUN_ID}-client-00.json"
    monkeypatch.setenv("EFTGUARD_HOME", str(tmp_path / "home"))
    assert PrivacyLedger(tmp_path / "ledgers", 0).mark_path(RUN_ID) == tmp_path / "home" / "ledger-marks" / folder / name
    monkeypatch.delenv("EFTGUARD_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert PrivacyLedger(tmp_path / "ledgers", 0).mark_path(RUN_ID) == \
        tmp_path / "user" / ".eftguard" / "ledger-marks" / folder / name
    assert PrivacyLedger(tmp_path / "ledgers", 0, marks=tmp_path / "marks").mark_path(RUN_ID) == \
        tmp_path / "marks" / folder / name


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
