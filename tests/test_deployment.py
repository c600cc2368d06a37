"""Deployment (eftguard/federation/deployment.py). First as a user runs it and as an attacker or an accident meets
it: `eftguard certs`, `superlink`, `supernode`, `register-node` and `train --federation deployment` on 127.0.0.1.
Every process a test starts is stopped (LocalDeployment's exit, or the fixture's finally).

Then the commands and node configuration `eftguard superlink` and `supernode` hand to Flower, built without starting
anything: TLS unless plaintext is asked for, certificates that name the Control address, node auth, and the node's
own settings; then the process layer (`run_superlink`, `run_supernode`, `register_node`, `run_deployed`) with every
started process replaced by a recorder: exact commands and environments, timeouts, and every started process stopped,
in order, whatever ends the run. The in-process tests (all but the `slow` ones, which start Flower) are fast enough
for the mutation check of deployment.py (docs/mutation.md)."""

import io
import json
import math
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import tomllib
import types
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from cryptography import x509
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from eftguard import cli
from eftguard.defenses.node_auth import write_node_key
from eftguard.defenses.tls import CertificateError, read_ca_certificates, write_certificates
from eftguard.errors import ConfigError, FederationError
from eftguard.federation import deployment
from eftguard.federation.deployment import (SupernodeLogCheck, check_tls_choice, connection_config, node_config,
                                            run_supernode, superlink_command, supernode_command)
from eftguard.federation.fleet_gateway import fleet_gateway
from eftguard.federation.local_deployment import LocalDeployment
from eftguard.rundir import RunError
from helpers import SECURE_RUN, check_secure_run, gpus_found

AUTO = "cuda" if torch.cuda.is_available() else "cpu"  # what --device auto (the default) becomes on this machine


@pytest.fixture
def certs(tmp_path):
    return write_certificates(tmp_path / "certs")


@pytest.fixture
def nothing_starts(monkeypatch):
    """Bad input must be refused before any process starts."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")
    monkeypatch.setattr(subprocess, "Popen", refuse)


def eftguard_error(capsys, *argv):
    """Run the CLI in-process; return its one error line (exit code 2 required)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert err.startswith("eftguard: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def supernode_args(certs, *extra):
    return ["supernode", "--superlink", "127.0.0.1:9", "--root-certificates", str(certs.ca_cert), "--partition", "0",
            "--clients", "2", *extra]


# --- the Control API stays on loopback ---------------------------------------------------------------------

def test_fleet_gateway_forwards_only_fleet_calls():
    """An outsider at the public port tries the Control and Runtime APIs, also by path tricks: nothing of it reaches
    Flower. A SuperNode's Fleet call reaches it unchanged, with its signature headers, and gets Flower's reply."""
    seen = []

    async def flower(request):
        seen.append((request.method, request.url.path, await request.body(), dict(request.headers)))
        return Response(b"\x08\x01reply", status_code=200, media_type="application/protobuf")

    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=Starlette(routes=[
        Route("/{path:path}", flower, methods=["GET", "POST"])])), base_url="http://flower")
    with TestClient(fleet_gateway(upstream)) as outsider:
        for method, path in [("POST", "/v1/control/list-runs"), ("POST", "/v1/control/register-node"),
                             ("POST", "/v1/runtime/pull-messages"), ("POST", "/v1/fleet/../control/list-runs"),
                             ("POST", "/v1/fleet/%2e%2e/control/list-runs"), ("POST", "/v1/fleet//control"),
                             ("GET", "/v1/fleet/pull-messages"), ("GET", "/docs"), ("POST", "/v1/fleet/")]:
            reply = outsider.request(method, path, content=b"x")
            assert reply.status_code == 404 and "only the Fleet API" in reply.text, (method, path)
        assert seen == []
        reply = outsider.post("/v1/fleet/pull-messages", content=b"\x0a\x02hi",
                              headers={"content-type": "application/protobuf", "flwr-signature": "c2ln"})
    assert (reply.status_code, reply.content) == (200, b"\x08\x01reply")
    [(method, path, body, headers)] = seen
    assert (method, path, body, headers["flwr-signature"]) == ("POST", "/v1/fleet/pull-messages", b"\x0a\x02hi", "c2ln")


def listening(process):
    """(ip, port) of every listening TCP socket of a process and its children."""
    pids = {process.pid} | {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
    return {(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids}


def flwr_ls(federation, address):
    home = federation.folder / f"flwr-ls-{address.replace(':', '-')}"
    home.mkdir()
    (home / "config.toml").write_text(connection_config(address, federation.ca_cert, insecure=False))
    return subprocess.run([str(Path(sys.executable).with_name("flwr")), "ls", "eftguard"], capture_output=True,
                          text=True, env={**federation.env, "FLWR_HOME": str(home)}, timeout=120)


def test_superlink_refuses_a_taken_control_port_or_a_certificate_without_the_control_address(certs, capsys,
                                                                                             monkeypatch):
    monkeypatch.setattr(deployment, "run_superlink", lambda *args: pytest.fail("a SuperLink was started"))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        err = eftguard_error(capsys, "superlink", "--certs", str(certs.folder), "--control-port", str(taken),
                             "--port", "0")
    assert f"--control-port {taken} is already in use" in err
    err = eftguard_error(capsys, "superlink", "--certs", str(certs.folder), "--control-host", "127.0.0.3",
                         "--port", "0")
    assert "does not name the Control address 127.0.0.3" in err and "--san 127.0.0.3" in err


@pytest.mark.parametrize("control_host", [None, "0.0.0.0"])
def test_flower_listens_on_the_control_address_and_only_the_gateway_on_host(tmp_path, capsys, monkeypatch,
                                                                             control_host):
    """Flower gets --control-host (loopback unless the operator insists, with a warning); --host/--port is the
    gateway's socket."""
    started = []

    def run_superlink(command, listener, *rest):
        started.append((command, listener.getsockname()))
        listener.close()
        return 0

    monkeypatch.setattr(deployment, "run_superlink", run_superlink)
    monkeypatch.setattr(deployment, "check_port_free", lambda *args: None)
    files = write_certificates(tmp_path / "certs", ("127.0.0.1", *([control_host] if control_host else [])))
    with pytest.raises(SystemExit):
        cli.main(["superlink", "--certs", str(files.folder), "--port", "0", "--control-port", "9093",
                  *(["--control-host", control_host] if control_host else [])])
    [(command, (fleet_host, fleet_port))] = started
    flower_address = command[command.index("--host") + 1], command[command.index("--port") + 1]
    assert flower_address == (control_host or "127.0.0.1", "9093")
    assert fleet_host == "127.0.0.1" and fleet_port != 9093
    warned = "Control API has no account authentication" in capsys.readouterr().err
    assert warned == (control_host is not None)


# --- bad CA files, taken ports, a SuperNode that cannot go on ----------------------------------------------

@pytest.mark.parametrize("damage", ["system file", "server certificate", "truncated", "empty", "folder"])
def test_supernode_refuses_a_ca_file_that_is_not_a_ca_before_starting(certs, capsys, nothing_starts, damage):
    """Flower printed an ssl.SSLError traceback for --root-certificates /etc/passwd, then hung."""
    bad = {"system file": Path("/etc/passwd"), "server certificate": certs.server_cert,
           "truncated": certs.folder / "half.crt", "empty": certs.folder / "empty.crt",
           "folder": certs.folder}[damage]
    (certs.folder / "half.crt").write_bytes(certs.ca_cert.read_bytes()[:200])
    (certs.folder / "empty.crt").write_bytes(b"")
    args = supernode_args(certs)
    args[args.index("--root-certificates") + 1] = str(bad)
    err = eftguard_error(capsys, *args)
    assert f"--root-certificates {bad}" in err and ("ca.crt" in err)


def test_the_ca_written_by_certs_is_accepted(certs):
    [ca] = read_ca_certificates(certs.ca_cert)
    assert ca.subject == ca.issuer


FATAL_SSL = textwrap.dedent('''
    import sys, time
    print("INFO:     Uvicorn running on http://127.0.0.1:45991 (Press CTRL+C to quit)")
    print("Traceback (most recent call last):")
    print('  File "/venv/bin/flower-supernode", line 8, in <module>')
    print("    sys.exit(flower_supernode())")
    print("ssl.SSLError: no start line: cadata does not contain a certificate (_ssl.c:4020)")
    sys.stdout.flush()
    time.sleep(600)  # Flower's HTTP thread keeps the process alive
''')
RECOVERED = textwrap.dedent('''
    print("Traceback (most recent call last):")
    print('  File "/venv/bin/flwr-clientapp", line 8, in <module>')
    print("ValueError: a ClientApp failed; the SuperNode reports it and goes on")
    raise SystemExit(3)
''')


@pytest.mark.timeout(60)
def test_supernode_stops_when_its_main_thread_died_instead_of_hanging(capsys):
    with pytest.raises(FederationError, match="cannot recover from: ssl.SSLError: no start line"):
        run_supernode([sys.executable, "-c", FATAL_SSL])
    assert not [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(60)
def test_supernode_goes_on_after_a_client_app_traceback_and_returns_its_exit_code():
    assert run_supernode([sys.executable, "-c", RECOVERED]) == 3


def test_second_supernode_on_the_same_port_gets_one_line_naming_port(certs, capsys, nothing_starts):
    with socket.socket() as first_supernode:
        first_supernode.bind(("127.0.0.1", 0))
        first_supernode.listen()
        port = first_supernode.getsockname()[1]
        err = eftguard_error(capsys, *supernode_args(certs, "--port", str(port)))
    assert f"--port {port} is already in use" in err and "its own --port" in err


def test_port_taken_after_the_check_is_still_reported_as_port():
    """The port can be taken between eftguard's check and Flower's bind: Flower's log line is recognised."""
    check = SupernodeLogCheck()
    with pytest.raises(FederationError, match="--port is already in use"):
        check("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 9100): "
              "address already in use\n")


# --- certificates ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("san", ["http://evil/x", "999.1.1.1", "", "10.0.0.256", "a..example.org", "-node.example",
                                 "node_1.example", "fl.example.org:9092", "x" * 64 + ".org", "host name"])
def test_certs_refuses_a_san_that_is_no_address(tmp_path, capsys, san):
    err = eftguard_error(capsys, "certs", "--out", str(tmp_path / "certs"), "--san", "127.0.0.1", f"--san={san}")
    assert f"--san {san!r}" in err
    assert not (tmp_path / "certs").exists()


def test_sans_are_written_as_ip_addresses_or_dns_names(tmp_path):
    from cryptography import x509

    files = write_certificates(tmp_path, ("fl.example.org", "10.0.0.5", "::1", "node-1"))
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["fl.example.org", "node-1"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", "::1", "127.0.0.1"]


def test_certificates_are_a_proper_ca_and_server_pair(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    files = write_certificates(tmp_path, ("127.0.0.1", "fl.example.org"))
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    server.verify_directly_issued_by(ca)
    assert oct(files.server_key.stat().st_mode & 0o777) == "0o600" and oct(files.ca_key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(CertificateError, match="--force"):
        write_certificates(tmp_path)
    write_certificates(tmp_path, force=True)
    assert x509.load_pem_x509_certificate(files.ca_cert.read_bytes()) != ca


def test_node_keys_are_openssh_ec_pairs(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    private, public = write_node_key(tmp_path / "node")
    key = load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert load_ssh_public_key(public.read_bytes()) == key.public_key()
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(CertificateError, match="--force"):
        write_node_key(tmp_path / "node")


# --- node configuration ------------------------------------------------------------------------------------

def node_config_of(monkeypatch, certs, *flags):
    """The --node-config that `eftguard supernode FLAGS` hands to Flower, parsed by Flower's own parser."""
    from flwr.common.config import parse_config_args

    commands = []
    monkeypatch.setattr(deployment, "run_supernode", lambda command: commands.append(command) or 0)
    monkeypatch.setattr(deployment, "check_port_free", lambda *args: None)
    with pytest.raises(SystemExit):
        cli.main(supernode_args(certs, *flags))
    [command] = commands
    return parse_config_args([command[command.index("--node-config") + 1]])


def test_supernode_flags_reach_the_node_config(tmp_path, certs, monkeypatch):
    ledger = tmp_path / "my ledger"
    config = node_config_of(monkeypatch, certs, "--share-truth", "--ledger-dir", str(ledger), "--max-epsilon", "2.5",
                            "--noise-secret", "7")
    assert config == {"partition-id": 0, "num-partitions": 2, "share-truth": True, "ledger-dir": str(ledger),
                      "max-epsilon": 2.5, "noise-secret": 7, "model-check": True, "device": AUTO}


def test_a_deployed_node_shares_no_truth_unless_told(certs, monkeypatch):
    """No ledger-dir: the node's ClientApp uses its default ($EFTGUARD_HOME/ledger)."""
    config = node_config_of(monkeypatch, certs)
    assert config == {"partition-id": 0, "num-partitions": 2, "share-truth": False, "model-check": True,
                      "device": AUTO}


def test_supernode_model_check_flags_reach_the_node_config(tmp_path, certs, monkeypatch):
    """The anchor of the node's model check: its own copy of the initial checkpoint (as an absolute path: the
    ClientApp does not run in this folder), or trust on first use; the check itself can be turned off."""
    monkeypatch.chdir(tmp_path)
    Path("start.pt").write_bytes(b"checkpoint")
    assert node_config_of(monkeypatch, certs, "--initial-model", "start.pt") == {
        "partition-id": 0, "num-partitions": 2, "share-truth": False, "model-check": True,
        "initial-model": str(tmp_path / "start.pt"), "device": AUTO}
    assert node_config_of(monkeypatch, certs, "--trust-first-model") == {
        "partition-id": 0, "num-partitions": 2, "share-truth": False, "model-check": True,
        "trust-first-model": True, "device": AUTO}
    assert node_config_of(monkeypatch, certs, "--no-model-check")["model-check"] is False


@pytest.mark.parametrize("flag, device", [("cuda:1", "cuda:1"), ("cuda", "cuda"), ("auto", "cuda"), ("cpu", "cpu")])
def test_supernode_device_reaches_the_node_config_resolved_on_the_node(certs, monkeypatch, flag, device):
    """The node's ClientApp trains where the node config's device says: auto is resolved on the node's host."""
    gpus_found(monkeypatch, 2)
    assert node_config_of(monkeypatch, certs, "--device", flag)["device"] == device


@pytest.mark.parametrize("gpus, flag, named", [(0, "cuda", "torch finds no CUDA GPU here"),
                                               (0, "cuda:0", "torch finds no CUDA GPU here"),
                                               (2, "cuda:2", "this machine has 2 CUDA GPU(s), numbered 0..1")])
def test_supernode_refuses_a_gpu_its_torch_does_not_find_before_the_node_starts(certs, capsys, monkeypatch,
                                                                                nothing_starts, gpus, flag, named):
    gpus_found(monkeypatch, gpus)
    monkeypatch.setattr(deployment, "run_supernode", lambda command: pytest.fail("the SuperNode started"))
    assert eftguard_error(capsys, *supernode_args(certs, "--device", flag)) == f"eftguard: error: --device {flag}: " + (
        named if gpus else f"{named} (torch {torch.__version__}, cuda available: no): give --device cpu or auto")


@pytest.mark.parametrize("flags, named", [(["--max-epsilon", "nan"], "--max-epsilon"),
                                          (["--max-epsilon", "inf"], "--max-epsilon"),
                                          (["--max-epsilon", "0"], "--max-epsilon"),
                                          (["--ledger-dir", "/etc/passwd"], "--ledger-dir"),
                                          (["--partition", "2"], "--partition")])
def test_supernode_refuses_bad_node_flags(certs, capsys, nothing_starts, flags, named):
    assert named in eftguard_error(capsys, *supernode_args(certs, *flags))


# --- TLS choice and connection files -----------------------------------------------------------------------

def test_tls_is_the_default_and_plaintext_must_be_asked_for(certs, capsys):
    with pytest.raises(ConfigError, match="TLS is the default"):
        check_tls_choice(None, insecure=False)
    with pytest.raises(ConfigError, match="not both"):
        check_tls_choice(certs.ca_cert, insecure=True)
    with pytest.raises(ConfigError, match="does not exist"):
        check_tls_choice(certs.folder / "missing.crt", insecure=False)
    check_tls_choice(None, insecure=True)
    assert "unencrypted" in capsys.readouterr().err


def test_connection_config_names_tls_or_plaintext(tmp_path):
    tls = tomllib.loads(connection_config("10.0.0.1:9093", tmp_path / "ca.crt", insecure=False))
    assert tls["superlink"]["default"] == "eftguard"
    assert tls["superlink"]["eftguard"] == {"address": "10.0.0.1:9093", "root-certificates": str(tmp_path / "ca.crt")}
    plain = tomllib.loads(connection_config("127.0.0.1:9093", None, insecure=True))
    assert plain["superlink"]["eftguard"]["insecure"] is True


# --- whole deployments (real Flower processes) -------------------------------------------------------------

def check_the_control_api_listens_on_loopback_only(federation):
    """The Control API is a separate port bound to 127.0.0.1; the public port is the Fleet gateway's."""
    superlink = federation.started[0].process
    fleet_port = int(federation.fleet_address.rsplit(":", 1)[1])
    control_port = int(federation.control_address.rsplit(":", 1)[1])
    sockets = listening(superlink)
    assert fleet_port != control_port
    assert {(ip, port) for ip, port, pid in sockets if pid == superlink.pid} == {("127.0.0.1", fleet_port)}
    assert {(ip, port) for ip, port, pid in sockets if pid != superlink.pid} == {("127.0.0.1", control_port)}


def check_an_outsider_can_neither_list_runs_nor_register_a_key(federation, keys):
    """Someone holding the public ca.crt at the SuperLink's public port gets nowhere; the operator on loopback does."""
    outsider = flwr_ls(federation, federation.fleet_address)
    assert outsider.returncode != 0 and "404" in outsider.stdout + outsider.stderr
    operator = flwr_ls(federation, federation.control_address)
    assert operator.returncode == 0, operator.stdout + operator.stderr
    _, intruder = write_node_key(keys / "intruder")
    with pytest.raises(subprocess.CalledProcessError) as refused:
        federation.eftguard("register-node", str(intruder), "--superlink", federation.fleet_address,
                            "--root-certificates", str(federation.ca_cert))
    assert refused.value.returncode == 2 and "registering" in refused.value.stderr


def start_a_supernode_trusting_another_ca(federation, folder):
    trusted, federation.ca_cert = federation.ca_cert, write_certificates(folder).ca_cert
    try:
        return federation.start_supernode(0, 2, log="wrong-ca.log")
    finally:
        federation.ca_cert = trusted


@contextmanager
def trained_in_deployment(federation, out, *options):
    """`eftguard train` of two clients on the deployment, its output in OUT.log (a file: a full pipe would stall
    it); the body runs while it trains, then it must end well within 400 s, and is killed otherwise."""
    log = out.with_suffix(".log")
    with open(log, "w") as training_log:
        training = subprocess.Popen(
            [sys.executable, "-m", "eftguard.cli", "train", "--federation", "deployment", "--superlink",
             federation.control_address, "--root-certificates", str(federation.ca_cert), "--out", str(out),
             "--clients", "2", *options], env=federation.env, stdout=training_log, stderr=training_log)
    try:
        yield
        training.wait(timeout=400)
    finally:
        training.kill()  # a no-op once it ended
        training.wait()
    logs = "".join((federation.folder / f).read_text()[-1500:] for f in ("superlink.log", "supernode0.log"))
    assert training.returncode == 0, log.read_text()[-1500:] + logs


@pytest.mark.slow
def test_eftvit_and_secagg_rounds_over_tls_with_node_auth_while_the_control_api_stays_on_loopback_and_strangers_are_refused(
        tmp_path):
    """One deployment (each costs about 100 s), TLS with node authentication on (it covers plain TLS too): two
    EFTViT rounds train while, meanwhile, the Control API is shown to be on loopback only (--node-auth with an
    outsider holding the public ca.crt), an unregistered SuperNode is refused and one trusting another CA fails with
    one clear error. The refusals run while the rounds wait on their clients: they cost no extra deployment. Then a
    second run on the same SuperNodes trains a round under --secagg (Flower's SecAgg+ over TLS)."""
    with LocalDeployment(tmp_path, node_auth=True) as federation:
        check_the_control_api_listens_on_loopback_only(federation)
        with ThreadPoolExecutor(2) as both:  # each registration and start waits on a process's start-up
            list(both.map(lambda k: federation.start_supernode(k, 2, "--auth-key",
                                                               str(federation.registered_key(f"node{k}"))), range(2)))
        out = tmp_path / "run"
        with trained_in_deployment(federation, out, "--model", "vit-micro-32", "--rounds", "2", "--train-samples",
                                   "100", "--test-samples", "40", "--batch-size", "32"):
            check_an_outsider_can_neither_list_runs_nor_register_a_key(federation, tmp_path / "keys")
            stranger_key, _ = write_node_key(tmp_path / "keys" / "stranger")
            stranger = federation.start_supernode(0, 2, "--auth-key", str(stranger_key), log="stranger.log")
            wrong_ca = start_a_supernode_trusting_another_ca(federation, tmp_path / "other")
            assert stranger.wait(seconds=120) == 2 and wrong_ca.wait(seconds=120) == 2
        with trained_in_deployment(federation, tmp_path / "secure", *SECURE_RUN):
            pass
    check_secure_run(tmp_path / "secure")
    assert "its key is not registered" in (tmp_path / "stranger.log").read_text()
    assert "TLS verification failed" in (tmp_path / "wrong-ca.log").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and all(r["dropped"] == {} for r in records)
    assert (out / "observed/round-0002/client-01/features.safetensors").exists()


# --- the commands and the process layer, nothing started ------------------------------------------------------------

@pytest.fixture
def flower(monkeypatch):
    """Flower's commands by name, wherever they are installed."""
    monkeypatch.setattr(deployment, "flower_executable", lambda name: f"/bin/{name}")
    monkeypatch.setattr(deployment, "check_port_free", lambda *args: None)


def test_superlink_serves_tls_with_the_written_certificates_on_the_control_address(tmp_path, flower):
    files = write_certificates(tmp_path, ("10.0.0.5",))
    assert superlink_command(tmp_path, False, "127.0.0.1", 9093, node_auth=True) == [
        "/bin/flower-superlink", "--host", "127.0.0.1", "--port", "9093", "--disable-runtime-dependency-installation",
        "--enable-supernode-auth", "--ssl-ca-certfile", str(files.ca_cert), "--ssl-certfile", str(files.server_cert),
        "--ssl-keyfile", str(files.server_key)]
    assert superlink_command(None, True, "::1", 9093) == [
        "/bin/flower-superlink", "--host", "::1", "--port", "9093", "--disable-runtime-dependency-installation",
        "--insecure"]


@pytest.mark.parametrize("missing", ["ca.crt", "server.pem", "server.key"])
def test_superlink_without_a_certificate_file_is_refused_naming_it(tmp_path, flower, missing):
    write_certificates(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(ConfigError, match=rf"^{tmp_path / missing} is missing: create certificates with eftguard "
                                          rf"certs --out {tmp_path}$"):
        superlink_command(tmp_path, False, "127.0.0.1", 9093)


@pytest.mark.parametrize("host", ["10.0.0.9", "[::2]", "other.example.org"])
def test_certificate_that_does_not_name_the_control_address_is_refused(tmp_path, flower, host):
    write_certificates(tmp_path, ("10.0.0.5", "fl.example.org", "::1", "Xnode.example"))
    with pytest.raises(ConfigError, match=rf"does not name the Control address {re.escape(host)}: "
                                          rf"recreate the certificates with eftguard certs --san "):
        superlink_command(tmp_path, False, host, 9093)
    for named in ("fl.example.org", "[::1]", "10.0.0.5", "Xnode.example"):  # only the brackets are stripped
        superlink_command(tmp_path, False, named, 9093)


def test_supernode_trusts_the_given_ca_unless_plaintext_is_asked_for(tmp_path, flower):
    (tmp_path / "node").write_text("key")
    assert supernode_command("fl:9092", tmp_path / "ca.crt", False, 9094, "partition-id=0",
                             auth_key=tmp_path / "node") == [
        "/bin/flower-supernode", "--superlink", "fl:9092", "--port", "9094", "--node-config", "partition-id=0",
        "--auth-supernode-private-key", str(tmp_path / "node"), "--root-certificates", str(tmp_path / "ca.crt")]
    assert supernode_command("fl:9092", None, True, 9094, "c")[-1] == "--insecure"
    with pytest.raises(ConfigError, match=rf"^--auth-key {tmp_path / 'absent'} does not exist \(create one with "
                                          r"eftguard node-key\)$"):
        supernode_command("fl:9092", None, True, 9094, "c", auth_key=tmp_path / "absent")
    with pytest.raises(ConfigError, match=rf"^--auth-key {tmp_path} is a folder \(create one with eftguard node-key\)$"):
        supernode_command("fl:9092", None, True, 9094, "c", auth_key=tmp_path)


def test_node_config_carries_the_nodes_own_settings(tmp_path, monkeypatch):
    assert node_config(0, 2) == 'partition-id=0 num-partitions=2 share-truth=false model-check=true device="cpu"'
    ledger = tmp_path / "Ledger X folder"  # spaces and capitals are carried
    gpus_found(monkeypatch, 1)
    assert node_config(1, 2, noise_secret=0, share_truth=True, ledger_dir=ledger, max_epsilon=0.5,
                       device="cuda:0") == (
        f'partition-id=1 num-partitions=2 share-truth=true noise-secret=0 ledger-dir="{ledger}" max-epsilon=0.5 '
        'model-check=true device="cuda:0"')


@pytest.mark.parametrize("changes, message", [
    ({"partition": 2}, r"^--partition must be between 0 and --clients - 1 \(1\), got 2$"),
    ({"partition": -1}, r"^--partition must be between 0 and --clients - 1 \(1\), got -1$"),
    ({"max_epsilon": 0.0}, r"^--max-epsilon must be a positive finite number, got 0.0$"),
    ({"max_epsilon": math.inf}, "got inf"), ({"max_epsilon": math.nan}, "got nan"),
    ({"ledger_dir": 'a"b'}, r"Flower's --node-config cannot carry a path with quotes or line breaks"),
    ({"ledger_dir": "a\nb"}, "cannot carry"), ({"ledger_dir": "a\rb"}, "cannot carry"),
    ({"device": "cuda"}, r"^--device cuda: torch finds no CUDA GPU here \("),
])
def test_node_settings_flower_cannot_carry_are_refused(tmp_path, monkeypatch, changes, message):
    monkeypatch.chdir(tmp_path)
    gpus_found(monkeypatch, 0)
    with pytest.raises(ConfigError, match=message):
        node_config(**{"partition": 0, "clients": 2, **changes})


def test_node_config_carries_the_model_checks_anchor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "start.pt").write_bytes(b"checkpoint")
    assert node_config(0, 2, model_check=False, initial_model=Path("start.pt")) == (
        f'partition-id=0 num-partitions=2 share-truth=false model-check=false initial-model="{tmp_path / "start.pt"}" '
        'device="cpu"')
    assert node_config(0, 2, trust_first_model=True) == (
        'partition-id=0 num-partitions=2 share-truth=false model-check=true trust-first-model=true device="cpu"')


@pytest.mark.parametrize("changes, message", [
    ({"initial_model": "missing.pt"}, "^--initial-model missing.pt does not exist: give the node's copy of the "
                                      "checkpoint the run starts from$"),
    ({"initial_model": "."}, r"^--initial-model \. is a folder: give the node's copy of the checkpoint the run "
                             "starts from$"),
    ({"initial_model": "start.pt", "trust_first_model": True},
     "^--initial-model and --trust-first-model exclude each other: the node rebuilds the run's initial model from "
     "the file, or trusts the first model it receives$"),
])
def test_a_model_check_anchor_the_node_cannot_use_is_refused(tmp_path, monkeypatch, changes, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "start.pt").write_bytes(b"checkpoint")
    with pytest.raises(ConfigError, match=message):
        node_config(**{"partition": 0, "clients": 2, **changes})


@pytest.mark.parametrize("flag, name", [("--ledger-dir", 'a"ledger'), ("--initial-model", 'a"b.pt')])
def test_a_path_flower_cannot_carry_is_refused_naming_its_flag_and_the_path(tmp_path, monkeypatch, flag, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'a"b.pt').write_bytes(b"checkpoint")
    with pytest.raises(ConfigError) as refused:
        node_config(0, 2, **{flag.removeprefix("--").replace("-", "_"): name})
    path = str(tmp_path / name)
    assert str(refused.value) == (f"{flag} {path!r}: Flower's --node-config cannot carry a path with quotes or line "
                                  "breaks; choose another place")


def test_ledger_folder_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "ledger").write_text("x")
    with pytest.raises(ConfigError, match=rf"^--ledger-dir {tmp_path / 'ledger'} is a file: give a folder"):
        node_config(0, 2, ledger_dir=tmp_path / "ledger")
    with pytest.raises(ConfigError, match=rf"^--ledger-dir {tmp_path / 'ledger' / 'node'} is under "
                                          rf"{tmp_path / 'ledger'}, which is a file: give a folder"):
        node_config(0, 2, ledger_dir=tmp_path / "ledger" / "node")
    assert "ledger-dir=" in node_config(0, 2, ledger_dir=tmp_path / "new" / "ledger")  # made by the node when needed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger"]  # the check wrote nothing


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_ledger_folder_where_nothing_can_be_written_is_refused_before_the_node_starts():
    """Each round would have failed on the node instead, which records its privacy spending before it uploads."""
    with pytest.raises(ConfigError, match=r"^--ledger-dir /proc/ledger: no file can be created there \(.+\): give a "
                                          r"folder you can write to for the node's privacy ledger$"):
        node_config(0, 2, ledger_dir=Path("/proc/ledger"))


def test_flower_commands_come_from_this_environment_first(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin")
    env = deployment.flower_env(EXTRA="1")
    assert env["PATH"] == f"{Path(sys.executable).parent}:/usr/bin" and env["EXTRA"] == "1"


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.0.1", True), ("[::1]", True),
                                            ("localhost", True), ("10.0.0.5", False), ("[2001:db8::1]", False),
                                            ("fl.example.org", False), ("localhost.example.org", False)])
def test_loopback_is_recognised_in_every_spelling(host, loopback):
    """Whether the Control API stays off the network is decided by this."""
    assert deployment.is_loopback(host) is loopback


@pytest.mark.parametrize("host, inner", [("[::1]", "::1"), ("::1", "::1"), ("127.0.0.1", "127.0.0.1"),
                                         ("[[::1]]", "[::1]"), ("[::1", "[::1"), ("fl.example.org", "fl.example.org")])
def test_exactly_one_pair_of_brackets_is_taken_off(host, inner):
    assert deployment.unbracketed(host) == inner


def test_a_port_other_processes_must_be_told_cannot_be_left_to_chance():
    with pytest.raises(ConfigError, match=r"^--port must be a fixed port \(1..65535\), not 0: other processes connect "
                                          r"to it$"):
        deployment.check_port_free("127.0.0.1", 0, "--port")


# --- the process layer, with every started process replaced by a recorder ------------------------------------

class FakeProcess:
    """A started Flower process as the code under test sees it; `events` (shared with the test) records what was
    done to it, in order. `exit()` makes it end with a code; `ignores_sigterm`: wait(timeout) runs out; `on_wait`
    runs in the first wait (as a signal arriving then would)."""

    def __init__(self, events, output="", exit_code=None, ignores_sigterm=False, on_wait=None):
        self.pid, self.returncode, self.events = 4242, None, events
        self.stdout = io.StringIO(output)
        self.ignores_sigterm, self.on_wait = ignores_sigterm, on_wait
        self.ended = threading.Event()
        if exit_code is not None:  # it ends once its output is read
            self.exit(exit_code)

    def exit(self, code):
        self.returncode = code
        self.ended.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self.events.append(("wait", timeout))
        if self.on_wait:
            on_wait, self.on_wait = self.on_wait, None
            on_wait()
        if timeout is not None and self.ignores_sigterm and not self.ended.is_set():
            raise subprocess.TimeoutExpired("flower", timeout)
        assert self.ended.wait(timeout if timeout is not None else 10), "waited on a process that never ends"
        return self.returncode

    def terminate(self):
        self.events.append("terminate")
        if not self.ignores_sigterm:
            self.exit(-signal.SIGTERM)

    def kill(self):
        self.events.append("kill")
        self.exit(-signal.SIGKILL)


@pytest.fixture
def events():
    return []


@pytest.fixture
def sigterm_handler():
    """A known SIGTERM handler in place during the test: the code under test must put it back."""
    def handler(signum, frame):
        raise AssertionError("the test's own SIGTERM handler was called")
    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def group_kills(monkeypatch, events):
    """os.killpg recorded: it ends the fake processes of the returned {pid: process} as the signal would; any other
    pid has no group (left already)."""
    group = {}

    def killpg(pid, signum):
        events.append(("killpg", pid, signum))
        if pid not in group:
            raise ProcessLookupError(pid)
        if signum == signal.SIGKILL or not group[pid].ignores_sigterm:
            group[pid].exit(-signum)

    monkeypatch.setattr(os, "killpg", killpg)
    return group


def start_recorder(monkeypatch, events, group=None, **process_options):
    """Replace subprocess.Popen: each start is recorded as (command, keyword arguments, fake process) and its process
    put in `group` (see group_kills); returns the started list."""
    started = []

    def popen(command, **kwargs):
        events.append(("start", command[0]))
        started.append((command, kwargs, FakeProcess(events, **process_options)))
        if group is not None:
            group[started[-1][2].pid] = started[-1][2]
        return started[-1][2]

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def test_stop_waits_ten_seconds_after_sigterm_then_kills(events):
    polite = FakeProcess(events)
    deployment._stop(polite)
    assert events == ["terminate", ("wait", 10)] and polite.returncode == -signal.SIGTERM
    events.clear()
    stubborn = FakeProcess(events, ignores_sigterm=True)
    deployment._stop(stubborn)
    assert events == ["terminate", ("wait", 10), "kill", ("wait", None)] and stubborn.returncode == -signal.SIGKILL


def test_supernode_group_gets_sigterm_then_sigkill_and_a_vanished_one_is_no_error(events, group_kills):
    """The SuperNode's group holds its SuperExec and ClientApps: they are stopped with it."""
    group_kills[4242] = FakeProcess(events)
    deployment._stop_group(group_kills[4242])
    assert events == [("killpg", 4242, signal.SIGTERM), ("wait", 10)]
    events.clear()
    group_kills[4242] = FakeProcess(events, ignores_sigterm=True)
    deployment._stop_group(group_kills[4242])
    assert events == [("killpg", 4242, signal.SIGTERM), ("wait", 10), ("killpg", 4242, signal.SIGKILL)]
    assert group_kills[4242].returncode == -signal.SIGKILL
    events.clear()
    group_kills.clear()
    deployment._stop_group(FakeProcess(events))  # its group has already ended
    assert events == [("killpg", 4242, signal.SIGTERM)]


def test_bracketed_only_ipv6_addresses():
    assert [deployment._bracketed(h) for h in ("::1", "10.0.0.5", "fl.example.org")] == [
        "[::1]", "10.0.0.5", "fl.example.org"]


class FakeClock:
    """deployment's `time`: sleeping advances the clock by 0.25 s (an exact binary fraction) and is recorded."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += 0.25


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(deployment, "time", fake)
    return fake


@pytest.fixture
def closed_port():
    """A port bound on 127.0.0.1 but not (yet) listening: connecting is refused until .listen()."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield bound


class Starting(FakeProcess):
    """A SuperLink that, at its n-th look (poll), opens its port (`opens_at`) or exits with `exit_code` (`exits_at`)."""

    def __init__(self, events, socket_=None, opens_at=None, exits_at=None, exit_code=None):
        super().__init__(events)
        self.socket, self.opens_at, self.exits_at, self.exit_code = socket_, opens_at, exits_at, exit_code
        self.polls = 0

    def poll(self):
        self.polls += 1
        if self.polls == self.opens_at:
            self.socket.listen()
        if self.polls == self.exits_at:
            self.exit(self.exit_code)
        return self.returncode


def test_waiting_for_the_superlink_returns_once_its_port_accepts(events, clock, closed_port):
    port = closed_port.getsockname()[1]
    deployment._wait_until_listening(Starting(events, closed_port, opens_at=3), "127.0.0.1", port)
    assert clock.sleeps == [0.2, 0.2]


def test_waiting_for_the_superlink_reaches_a_bracketed_ipv6_address(events, clock):
    with socket.socket(socket.AF_INET6) as flower:
        flower.bind(("::1", 0))
        flower.listen()
        deployment._wait_until_listening(FakeProcess(events), "[::1]", flower.getsockname()[1])
    assert clock.sleeps == []


def test_a_superlink_that_exits_while_starting_is_reported_at_once_with_its_exit_code(events, clock, closed_port):
    port = closed_port.getsockname()[1]
    with pytest.raises(FederationError, match=r"^flower-superlink stopped while starting \(exit code 3\); see its "
                                              r"log above$"):
        deployment._wait_until_listening(Starting(events, exits_at=2, exit_code=3), "127.0.0.1", port)
    assert clock.sleeps == [0.2]


@pytest.mark.parametrize("limit, given", [({"seconds": 2}, 2), ({}, 120)])
def test_a_superlink_that_never_opens_its_port_is_given_up_at_the_deadline(events, clock, closed_port, limit, given):
    port = closed_port.getsockname()[1]
    with pytest.raises(FederationError, match=rf"^flower-superlink did not open 127.0.0.1:{port} within {given} s; "
                                              r"see its log above$"):
        deployment._wait_until_listening(Starting(events), "127.0.0.1", port, **limit)
    assert clock.sleeps == [0.2] * (given * 4) and clock.now == 1000.0 + given


class FakeListener:
    """The gateway's listening socket, as bind_listener returned it."""

    def __init__(self, events, address):
        self.events, self.address = events, address

    def getsockname(self):
        return self.address

    def close(self):
        self.events.append("listener closed")


def stops(events):
    """The events less the gateway's watcher waiting on Flower (a thread: its place in the order is chance)."""
    return [event for event in events if event != ("wait", None)]


@pytest.fixture
def superlink(monkeypatch, events, sigterm_handler):
    """run_superlink with Flower started by a recorder, the wait for its port and uvicorn replaced: returns a
    namespace whose `serve` (set by the test) plays the gateway's `run`, and whose fields record the rest."""
    import httpx
    import uvicorn

    from eftguard.federation import fleet_gateway

    seen = types.SimpleNamespace(started=start_recorder(monkeypatch, events), clients=[], configs=[], serve=None)
    real_client = httpx.AsyncClient

    def client(**kwargs):
        seen.clients.append((kwargs, real_client(**kwargs)))
        return seen.clients[-1][1]

    class Gateway:
        def __init__(self, config):
            self.config, self.stopped_by_flower = config, threading.Event()

        @property
        def should_exit(self):
            return self.stopped_by_flower.is_set()

        @should_exit.setter
        def should_exit(self, value):
            if value:
                self.stopped_by_flower.set()

        def run(self, sockets):
            events.append(("gateway serves", sockets))
            seen.serve(self)

    monkeypatch.setattr(httpx, "AsyncClient", client)
    monkeypatch.setattr(fleet_gateway, "fleet_gateway", lambda upstream: ("gateway of", upstream))
    monkeypatch.setattr(uvicorn, "Config", lambda app, **options: seen.configs.append((app, options)) or app)
    monkeypatch.setattr(uvicorn, "Server", Gateway)
    monkeypatch.setattr(deployment, "_wait_until_listening",
                        lambda process, host, port: events.append(("waited for", process, host, port)))
    return seen


def test_superlink_serves_the_gateway_over_tls_once_flower_listens_and_stops_flower_after(
        tmp_path, capsys, events, superlink, sigterm_handler):
    files = write_certificates(tmp_path, ("::1",))
    superlink.serve = lambda gateway: None  # uvicorn returns after the operator's Ctrl-C
    listener = FakeListener(events, ("::", 9092, 0, 0))
    assert deployment.run_superlink(["/bin/flower-superlink", "--x"], listener, "::1", 9093, tmp_path) == 0
    [(command, options, flower)] = superlink.started
    assert (command, options) == (["/bin/flower-superlink", "--x"], {"env": deployment.flower_env()})
    assert stops(events) == [("start", "/bin/flower-superlink"), ("waited for", flower, "::1", 9093),
                             ("gateway serves", [listener]), "listener closed", "terminate", ("wait", 10)]
    [(client, upstream)] = superlink.clients
    assert client["base_url"] == "https://[::1]:9093" and client["timeout"] == 120
    assert client["verify"].verify_mode == ssl.CERT_REQUIRED and client["verify"].check_hostname
    [trusted] = client["verify"].get_ca_certs()
    assert int(trusted["serialNumber"], 16) == x509.load_pem_x509_certificate(files.ca_cert.read_bytes()).serial_number
    [(app, config)] = superlink.configs
    assert app == ("gateway of", upstream)
    assert config == {"log_level": "warning", "lifespan": "on", "ssl_certfile": str(files.server_cert),
                      "ssl_keyfile": str(files.server_key)}
    assert capsys.readouterr().err == ("eftguard: Fleet API for SuperNodes on [::]:9092; Control API for eftguard "
                                       "train and register-node on [::1]:9093 only\n")
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler


def test_plaintext_superlink_gateway_has_no_certificates(events, superlink, capsys):
    superlink.serve = lambda gateway: None
    assert deployment.run_superlink(["flower"], FakeListener(events, ("10.0.0.5", 9092)), "127.0.0.1", 9093,
                                    None) == 0
    [(client, _)] = superlink.clients
    assert client["base_url"] == "http://127.0.0.1:9093" and client["verify"] is False
    assert superlink.configs[0][1] == {"log_level": "warning", "lifespan": "on", "ssl_certfile": None,
                                       "ssl_keyfile": None}
    assert "on 10.0.0.5:9092; Control API for eftguard train and register-node on 127.0.0.1:9093 only" in (
        capsys.readouterr().err)


def test_when_flower_stops_the_gateway_stops_and_the_exit_code_is_reported(events, superlink):
    def flower_dies(gateway):
        [(_, _, flower)] = superlink.started
        flower.exit(1)
        assert gateway.stopped_by_flower.wait(10), "the gateway kept serving without Flower"

    superlink.serve = flower_dies
    with pytest.raises(FederationError, match=r"^flower-superlink stopped \(exit code 1\); see its log above$"):
        deployment.run_superlink(["flower"], FakeListener(events, ("127.0.0.1", 9092)), "127.0.0.1", 9093, None)
    assert stops(events)[-3:] == ["listener closed", "terminate", ("wait", 10)]


def test_ctrl_c_returns_130_and_sigterm_exits_143_both_stopping_flower(events, superlink, sigterm_handler):
    def interrupted(gateway):
        raise KeyboardInterrupt

    superlink.serve = interrupted
    assert deployment.run_superlink(["flower"], FakeListener(events, ("127.0.0.1", 9092)), "127.0.0.1", 9093,
                                    None) == 130
    assert stops(events)[-3:] == ["listener closed", "terminate", ("wait", 10)]
    events.clear()
    superlink.serve = lambda gateway: signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as terminated:
        deployment.run_superlink(["flower"], FakeListener(events, ("127.0.0.1", 9092)), "127.0.0.1", 9093, None)
    assert terminated.value.code == 143
    assert stops(events)[-3:] == ["listener closed", "terminate", ("wait", 10)]
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler


def test_a_superlink_that_never_listens_is_stopped_with_its_listener(events, superlink, monkeypatch):
    def never(process, host, port):
        raise FederationError("did not open")

    monkeypatch.setattr(deployment, "_wait_until_listening", never)
    with pytest.raises(FederationError, match="did not open"):
        deployment.run_superlink(["flower"], FakeListener(events, ("127.0.0.1", 9092)), "127.0.0.1", 9093, None)
    assert stops(events) == [("start", "flower"), "listener closed", "terminate", ("wait", 10)]



# --- the SuperNode wrapper ----------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_supernode_log_is_passed_through_and_its_exit_code_returned_then_its_group_stopped(
        events, monkeypatch, capsys, group_kills, sigterm_handler):
    log = "INFO: Starting SuperNode\n\nINFO: connected\n"
    started = start_recorder(monkeypatch, events, group_kills, output=log, exit_code=7)
    assert deployment.run_supernode(["/bin/flower-supernode", "--x"]) == 7
    [(command, options, _)] = started
    assert command == ["/bin/flower-supernode", "--x"]
    assert options == {"env": deployment.flower_env(), "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT,
                       "text": True, "errors": "replace", "start_new_session": True}
    assert capsys.readouterr().err == log
    assert events == [("start", "/bin/flower-supernode"), ("wait", None), ("killpg", 4242, signal.SIGTERM),
                      ("wait", 10)]
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler


@pytest.mark.timeout(30)
def test_supernode_refused_by_the_superlink_is_stopped_at_once(events, monkeypatch, capsys, group_kills,
                                                                sigterm_handler):
    log = "INFO: Starting\nERROR: Failed to activate SuperNode\nINFO: retrying in 5 s\n"
    start_recorder(monkeypatch, events, group_kills, output=log, ignores_sigterm=True)
    with pytest.raises(FederationError, match="its key is not registered"):
        deployment.run_supernode(["flower-supernode"])
    assert capsys.readouterr().err == "INFO: Starting\nERROR: Failed to activate SuperNode\n"
    assert events == [("start", "flower-supernode"), ("killpg", 4242, signal.SIGTERM), ("wait", 10),
                      ("killpg", 4242, signal.SIGKILL)]
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler


@pytest.mark.timeout(30)
def test_sigterm_to_the_wrapper_exits_143_and_stops_the_supernodes_group(events, monkeypatch, group_kills,
                                                                           sigterm_handler):
    terminate_wrapper = lambda: signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # noqa: E731
    start_recorder(monkeypatch, events, group_kills, output="INFO: running\n", on_wait=terminate_wrapper)
    with pytest.raises(SystemExit) as terminated:
        deployment.run_supernode(["flower-supernode"])
    assert terminated.value.code == 143
    assert events == [("start", "flower-supernode"), ("wait", None), ("killpg", 4242, signal.SIGTERM), ("wait", 10)]
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler


@pytest.mark.timeout(60)
def test_a_log_byte_that_is_not_utf8_does_not_hang_the_wrapper(capfd):
    """One such byte from the SuperNode or a process it started ended the log reader with a UnicodeDecodeError; the
    wrapper then waited forever (and the SuperNode, its pipe full, too)."""
    write = "import sys; sys.stdout.buffer.write(b'before \\xff\\n'); sys.stdout.flush(); print('after'); sys.exit(4)"
    assert deployment.run_supernode([sys.executable, "-c", write]) == 4
    assert capfd.readouterr().err == "before \ufffd\nafter\n"


def supernode_traceback(frame):
    return ["Traceback (most recent call last):\n", f'  File "/venv/bin/{frame}", line 8, in <module>\n',
            "    sys.exit(flower_supernode())\n", "\n", "          ^^^^^\n"]


def test_a_traceback_through_the_supernodes_main_frame_is_fatal_on_its_error_line():
    check = SupernodeLogCheck()
    for line in ["INFO: started\n", *supernode_traceback("flower-supernode")]:
        check(line)
    with pytest.raises(FederationError, match=r"^the SuperNode stopped on an error it cannot recover from: "
                                              r"ssl.SSLError: no start line \(see its log above\)$"):
        check("ssl.SSLError: no start line\n")


def test_a_client_apps_traceback_or_a_later_main_frame_is_not_fatal():
    """Only a main-thread traceback stops the wrapper: the SuperNode reports a failed ClientApp and goes on."""
    check = SupernodeLogCheck()
    for line in [*supernode_traceback("flwr-clientapp"), "ValueError: one ClientApp failed\n",
                 "Traceback (most recent call last):\n", '  File "/venv/lib/thread.py", line 1, in run\n',
                 '  File "/venv/bin/flower-supernode", line 8, in <module>\n', "KeyError: 'x'\n", "INFO: next\n"]:
        check(line)  # raises FederationError if it took any of these lines as fatal
    # the same checker still stops on a real main-thread traceback afterwards
    for line in supernode_traceback("flower-supernode"):
        check(line)
    with pytest.raises(FederationError):
        check("ssl.SSLError: no start line\n")


@pytest.mark.parametrize("markers, message", deployment.SUPERNODE_FAILURES, ids=["tls", "node auth", "port"])
def test_every_known_failure_line_names_its_cause(markers, message):
    for marker in markers:
        with pytest.raises(FederationError) as raised:
            SupernodeLogCheck()(f"ERROR: grpc said: {marker} (details)\n")
        assert str(raised.value) == message


# --- `eftguard register-node` and `train --federation deployment`: flwr replaced by a recorder ---------------

def flwr_recorder(monkeypatch, reply):
    """Replace subprocess.run: records (command, keyword arguments, FLWR_HOME's config.toml as flwr would read it)
    and answers with reply(command), a CompletedProcess."""
    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs, (Path(kwargs["env"]["FLWR_HOME"]) / "config.toml").read_text()))
        return reply(command)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_register_node_runs_flwr_with_its_own_connection_file_and_prints_its_answer(tmp_path, monkeypatch, flower,
                                                                                   capsys):
    key = tmp_path / "node.pub"
    key.write_text("ecdsa-sha2-nistp256 AAAA")
    ca = write_certificates(tmp_path / "certs").ca_cert
    calls = flwr_recorder(monkeypatch, lambda command: subprocess.CompletedProcess(command, 0, "  registered 7\n", ""))
    deployment.register_node(key, "10.0.0.5:9093", ca, insecure=False)
    [(command, options, config)] = calls
    assert command == ["/bin/flwr", "supernode", "register", str(key), "eftguard"]
    home = options["env"]["FLWR_HOME"]
    assert options == {"env": deployment.flower_env(FLWR_HOME=home), "capture_output": True, "text": True,
                       "errors": "replace"}
    assert config == deployment.connection_config("10.0.0.5:9093", ca, insecure=False)
    assert not Path(home).exists(), "the connection file outlived the registration"
    assert capsys.readouterr().out == "registered 7\n"


def test_a_refused_registration_reports_flwrs_last_words(tmp_path, monkeypatch, flower):
    key = tmp_path / "node.pub"
    key.write_text("k")
    said = "x" * 600 + "\nError: the public key is already registered\n"
    flwr_recorder(monkeypatch, lambda command: subprocess.CompletedProcess(command, 1, said, "  (exit 1)\n"))
    with pytest.raises(FederationError) as refused:
        deployment.register_node(key, "127.0.0.1:9093", None, insecure=True)
    assert str(refused.value) == f"registering {key} failed: {(said + '  (exit 1)').strip()[-500:]}"


def test_register_node_checks_its_input_before_running_flwr(tmp_path, monkeypatch, flower):
    calls = flwr_recorder(monkeypatch, lambda command: pytest.fail("flwr ran"))
    with pytest.raises(ConfigError, match=rf"^public key {tmp_path / 'absent.pub'} does not exist \(eftguard "
                                          r"node-key writes KEY and KEY.pub\)$"):
        deployment.register_node(tmp_path / "absent.pub", "127.0.0.1:9093", None, insecure=True)
    with pytest.raises(ConfigError, match=r"^public key /dev/null is not a regular file \(eftguard node-key writes"):
        deployment.register_node(Path("/dev/null"), "127.0.0.1:9093", None, insecure=True)
    with pytest.raises(ConfigError, match="TLS is the default"):
        deployment.register_node(tmp_path / "absent.pub", "127.0.0.1:9093", None, insecure=False)
    assert calls == []


@pytest.fixture
def run_dir(tmp_path):
    from eftguard.config import TrainConfig
    from eftguard.rundir import RunDirectory

    RunDirectory.create(tmp_path / "my run", TrainConfig(rounds=2, federation="deployment"))
    return tmp_path / "my run"


def rounds_done(run_dir, rounds, code):
    """flwr's stand-in: the ServerApp completes `rounds` rounds (a checkpoint, then the metrics line), exits `code`."""
    import torch

    from eftguard.rundir import RunDirectory

    def reply(command):
        run = RunDirectory.open(run_dir)
        for k in range(1, rounds + 1):
            run.save_checkpoint(k, {"w": torch.zeros(1)})
            run.append_metrics({"round": k})
        return subprocess.CompletedProcess(command, code)
    return reply


def test_deployed_run_hands_flwr_the_app_and_the_absolute_run_dir(run_dir, monkeypatch, flower):
    monkeypatch.chdir(run_dir.parent)
    calls = flwr_recorder(monkeypatch, rounds_done(run_dir, 2, 0))
    deployment.run_deployed(Path(run_dir.name), "127.0.0.1:9093", None, insecure=True)
    [(command, options, config)] = calls
    assert command == ["/bin/flwr", "run", str(deployment.APP_DIR), "eftguard", "--stream", "-c",
                       f'run-dir="{run_dir}" device="cpu"']
    assert options == {"env": deployment.flower_env(FLWR_HOME=options["env"]["FLWR_HOME"])}
    assert config == deployment.connection_config("127.0.0.1:9093", None, insecure=True)
    assert not Path(options["env"]["FLWR_HOME"]).exists()


@pytest.mark.parametrize("flag, device", [("cuda:1", "cuda:1"), ("auto", "cuda"), ("cpu", "cpu")])
def test_a_deployed_runs_device_reaches_its_server_app(run_dir, monkeypatch, flower, capsys, flag, device):
    """eftguard train --device on the SuperLink's host (auto resolved there) -> flwr's run config, fused with the
    app's declared keys as the SuperLink fuses them -> the deployed ServerApp computes inside that device."""
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir, parse_config_args

    from eftguard.device import compute_device
    from eftguard.federation import apps, server

    gpus_found(monkeypatch, 2)
    calls = flwr_recorder(monkeypatch, lambda command: subprocess.CompletedProcess(command, 1))
    with pytest.raises(SystemExit):  # the stand-in ran no round
        cli.main(["train", "--resume", str(run_dir), "--device", flag, "--superlink", "127.0.0.1:9093", "--insecure"])
    assert "stopped after round 0 of 2" in capsys.readouterr().err
    [(command, _, _)] = calls
    run_config = get_fused_config_from_dir(deployment.APP_DIR, parse_config_args(command[command.index("-c") + 1:]))
    assert run_config == {"run-dir": str(run_dir), "device": device}
    served = []
    monkeypatch.setattr(server, "run_server", lambda grid, path, threat: served.append((path, compute_device())))
    apps.server_app(object(), Context(run_id=1, node_id=0, state=RecordDict({}), run_config=run_config,
                                      node_config={}))
    assert served == [(run_dir, torch.device(device))] and compute_device() == torch.device("cpu")


@pytest.mark.parametrize("insecure", [True, False])
def test_a_deployed_run_that_stops_early_names_the_round_and_how_to_go_on(run_dir, monkeypatch, flower, insecure):
    flwr_recorder(monkeypatch, rounds_done(run_dir, 1, 1))
    ca = None if insecure else write_certificates(run_dir.parent / "certs").ca_cert
    with pytest.raises(FederationError) as stopped:
        deployment.run_deployed(run_dir, "10.0.0.5:9092", ca, insecure)
    tls = (" If the SuperLink was reported unavailable, check that --root-certificates is the CA that signed the "
           "SuperLink's certificate (TLS).")
    assert str(stopped.value) == (
        "the deployed run stopped after round 1 of 2 (flwr exit code 1); see the output above. --superlink must be "
        "the SuperLink's Control address (127.0.0.1:9093 unless eftguard superlink was given --control-port), not "
        f"the Fleet address SuperNodes use.{'' if insecure else tls} Continue with eftguard train --resume {run_dir} "
        "--superlink 10.0.0.5:9092 ...")


def test_a_deployed_run_needs_a_superlink_and_a_run_directory(tmp_path, monkeypatch, flower):
    calls = flwr_recorder(monkeypatch, lambda command: pytest.fail("flwr ran"))
    with pytest.raises(ConfigError, match=r"^--federation deployment needs --superlink HOST:PORT \(the SuperLink's "
                                          r"address\)$"):
        deployment.run_deployed(tmp_path, None, None, insecure=True)
    with pytest.raises(ConfigError, match="TLS is the default"):
        deployment.run_deployed(tmp_path, "127.0.0.1:9093", None, insecure=False)
    with pytest.raises(RunError, match="is not an eftguard run directory"):
        deployment.run_deployed(tmp_path, "127.0.0.1:9093", None, insecure=True)
    assert calls == []


# --- where Flower's commands come from --------------------------------------------------------------------------

def test_flower_commands_are_taken_beside_this_python_then_from_path(tmp_path, monkeypatch):
    """Beside the interpreter first: a venv's Flower even when another Flower comes first on PATH."""
    venv, elsewhere = tmp_path / "venv" / "bin", tmp_path / "elsewhere"
    for tool in (venv / "flower-superlink", elsewhere / "flower-superlink", elsewhere / "flwr"):
        tool.parent.mkdir(parents=True, exist_ok=True)
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(elsewhere))
    assert deployment.flower_executable("flower-superlink") == str(venv / "flower-superlink")
    assert deployment.flower_executable("flwr") == str(elsewhere / "flwr")
    with pytest.raises(FederationError, match=r"^the `flower-supernode` command is missing: reinstall eftguard "
                                              r"\(pip install -e \.\)$"):
        deployment.flower_executable("flower-supernode")


def test_with_path_unset_flower_commands_come_from_this_environment_then_the_system_default(monkeypatch):
    """An empty PATH entry would be the current folder: a file named flwr there would run."""
    monkeypatch.delenv("PATH")
    assert deployment.flower_env()["PATH"] == f"{Path(sys.executable).parent}:{os.defpath}"


# --- listening sockets and the messages of bad input ----------------------------------------------------------

def test_listener_is_a_tcp_socket_that_accepts_on_any_spelling_of_its_address():
    for host in ("127.0.0.1", "[::1]"):
        with deployment.bind_listener(host, 0, "--port") as listener:
            assert listener.type == socket.SOCK_STREAM
            with socket.create_connection((host.strip("[]"), listener.getsockname()[1]), timeout=5):
                pass


@pytest.mark.parametrize("port", [65535, 0])
def test_listener_takes_every_port_number(port):
    """65535 is a port; 0 asks for a free one."""
    try:
        deployment.bind_listener("127.0.0.1", port, "--port").close()
    except ConfigError as taken:  # 65535 may be some other process's right now
        assert str(taken).startswith("--port 65535 is already in use on 127.0.0.1"), taken


@pytest.mark.parametrize("port", [65536, -1])
def test_a_number_that_is_no_port_is_refused(port):
    """getaddrinfo would wrap 65536 to port 0, a random port nobody is told."""
    with pytest.raises(ConfigError, match=rf"^--control-port {port} is not a port number \(0..65535\)$"):
        deployment.bind_listener("127.0.0.1", port, "--control-port")


def test_a_host_that_is_not_this_one_is_refused_naming_the_flags():
    with pytest.raises(ConfigError, match=r"^no-such-host.invalid is not an address of this host: check --host / "
                                          r"--control-host$"):
        deployment.bind_listener("no-such-host.invalid", 0, "--port")
    with pytest.raises(ConfigError, match=r"^cannot listen on 192.0.2.1:0 \(Cannot assign requested address\): "
                                          r"check --port and the host$"):
        deployment.bind_listener("192.0.2.1", 0, "--port")


def test_plaintext_is_warned_about_in_one_line(capsys):
    deployment.check_tls_choice(None, insecure=True)
    assert capsys.readouterr().err == "eftguard: warning: --insecure: uploads travel unencrypted\n"


def test_a_superlink_ca_that_is_no_ca_is_refused_naming_certs(tmp_path, flower):
    files = write_certificates(tmp_path)
    files.ca_cert.write_bytes(files.server_cert.read_bytes())
    with pytest.raises(CertificateError, match=rf"^--certs {files.ca_cert} is an end-entity certificate, not a CA"):
        superlink_command(tmp_path, False, "127.0.0.1", 9093)


@pytest.mark.parametrize("damage", ["a CA certificate", "not PEM"])
def test_a_server_certificate_not_from_eftguard_certs_is_refused(tmp_path, flower, damage):
    files = write_certificates(tmp_path)
    files.server_cert.write_bytes(files.ca_cert.read_bytes() if damage == "a CA certificate" else b"junk")
    with pytest.raises(ConfigError, match=rf"^{files.server_cert} is not a server certificate from eftguard certs: "
                                          r"recreate it$"):
        superlink_command(tmp_path, False, "127.0.0.1", 9093)


# --- issue 34: what Flower would serve regardless, or retry forever -----------------------------------------------

def write_issued(folder: Path, days_ago: float):
    """The files of eftguard certs, their certificates issued `days_ago` days ago (negative: in the future); the
    CA is valid for 3650 days, the server certificate for 825."""
    import datetime as dt

    from cryptography.hazmat.primitives.serialization import Encoding

    from eftguard.defenses.tls import DEFAULT_SANS, certificate_names, issue_certificates

    files = write_certificates(folder)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days_ago)
    _, ca_cert, _, server_cert = issue_certificates(certificate_names(DEFAULT_SANS), now=now)
    files.ca_cert.write_bytes(ca_cert.public_bytes(Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(Encoding.PEM))
    return files


@pytest.mark.parametrize("days_ago, which, message", [
    (900, "server.pem", r"^{path} expired on \d{4}-\d\d-\d\d \d\d:\d\d UTC: recreate the certificates with eftguard "
                        r"certs --force$"),
    (3700, "ca.crt", r"^--certs {path} expired on .* UTC: recreate the certificates with eftguard certs --force$"),
    (-10, "ca.crt", r"^--certs {path} is not valid before .* UTC: check this host's clock, or recreate"),
])
def test_a_superlink_certificate_outside_its_validity_is_refused_not_served(tmp_path, flower, days_ago, which,
                                                                              message):
    write_issued(tmp_path, days_ago)
    with pytest.raises(CertificateError, match=message.replace("{path}", re.escape(str(tmp_path / which)))):
        superlink_command(tmp_path, False, "127.0.0.1", 9093)


def test_an_expired_ca_is_refused_by_every_command_that_trusts_it(tmp_path, capsys):
    from conftest import run_cli

    files = write_issued(tmp_path, 3700)
    for argv in (["superlink", "--certs", tmp_path],
                 ["supernode", "--superlink", "127.0.0.1:9092", "--root-certificates", files.ca_cert,
                  "--partition", "0", "--clients", "2"],
                 ["register-node", files.ca_cert, "--root-certificates", files.ca_cert]):
        code, err = run_cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and f"{files.ca_cert} expired on " in err, err


@pytest.mark.parametrize("address", ["not an address", "127.0.0.1:70000", "127.0.0.1:65536", "127.0.0.1:0", "127.0.0.1",
                                     "::1:9092", "[fl.example.org]:9092", "999.1.1.1:9092", ":9092",
                                     "fl.example.org:port", "[127.0.0.1:9092", "127.0.0.1]:9092", "[127.0.0.1]:9092",
                                     "[::1]]:9092", "[[::1]:9092", "[::1:9092", "[]:9092", "X127.0.0.1:9092"])
def test_an_address_flower_would_retry_forever_is_refused_before_it_starts(tmp_path, capsys, monkeypatch, address):
    from conftest import run_cli

    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: pytest.fail("a process was started"))
    files = write_certificates(tmp_path)
    code, err = run_cli(capsys, "supernode", "--superlink", address, "--root-certificates", files.ca_cert,
                        "--partition", "0", "--clients", "2")
    assert code == 2 and err == (f"eftguard: error: --superlink {address!r} is not HOST:PORT (an IP address, [IPv6 "
                                 "address] or host name, and a port in 1..65535), e.g. 127.0.0.1:9092\n")


@pytest.mark.parametrize("address", ["127.0.0.1:9092", "[::1]:9092", "fl.example.org:1", "localhost:65535"])
def test_every_form_of_address_flower_takes_is_accepted(address):
    deployment.check_address(address)
