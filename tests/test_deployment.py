"""Deployment as a user runs it and as an attacker or an accident meets it: `eftguard certs`, `superlink`,
`supernode`, `register-node` and `train --federation deployment` on 127.0.0.1. Every process a test starts
is stopped (LocalDeployment's exit, or the fixture's finally)."""

import json
import socket
import subprocess
import sys
import textwrap
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from eftguard import cli
from eftguard.defenses.node_auth import write_node_key
from eftguard.defenses.tls import CertificateError, read_ca_certificates, write_certificates
from eftguard.errors import ConfigError, FederationError
from eftguard.federation import deployment
from eftguard.federation.deployment import SupernodeLogCheck, check_tls_choice, connection_config, run_supernode
from eftguard.federation.fleet_gateway import fleet_gateway
from eftguard.federation.local_deployment import LocalDeployment


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
                      "max-epsilon": 2.5, "noise-secret": 7, "model-check": True}


def test_a_deployed_node_shares_no_truth_unless_told(certs, monkeypatch):
    """No ledger-dir: the node's ClientApp uses its default ($EFTGUARD_HOME/ledger)."""
    config = node_config_of(monkeypatch, certs)
    assert config == {"partition-id": 0, "num-partitions": 2, "share-truth": False, "model-check": True}


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


@pytest.mark.slow
def test_eftvit_rounds_over_tls_with_node_auth_while_the_control_api_stays_on_loopback_and_strangers_are_refused(
        tmp_path):
    """One deployment (each costs about 100 s), TLS with node authentication on (it covers plain TLS too): two
    EFTViT rounds train while, meanwhile, the Control API is shown to be on loopback only (--node-auth with an
    outsider holding the public ca.crt), an unregistered SuperNode is refused and one trusting another CA fails with
    one clear error. The refusals run while the rounds wait on their clients: they cost no extra deployment."""
    with LocalDeployment(tmp_path, node_auth=True) as federation:
        check_the_control_api_listens_on_loopback_only(federation)
        with ThreadPoolExecutor(2) as both:  # each registration and start waits on a process's start-up
            list(both.map(lambda k: federation.start_supernode(k, 2, "--auth-key",
                                                               str(federation.registered_key(f"node{k}"))), range(2)))
        out = tmp_path / "run"
        with open(tmp_path / "train.log", "w") as training_log:  # a file: a full pipe would stall the training
            training = subprocess.Popen(
                [sys.executable, "-m", "eftguard.cli", "train", "--federation", "deployment", "--superlink",
                 federation.control_address, "--root-certificates", str(federation.ca_cert), "--out", str(out),
                 "--clients", "2", "--rounds", "2", "--train-samples", "100", "--test-samples", "40",
                 "--batch-size", "32"], env=federation.env, stdout=training_log, stderr=training_log)
        try:
            check_an_outsider_can_neither_list_runs_nor_register_a_key(federation, tmp_path / "keys")
            stranger_key, _ = write_node_key(tmp_path / "keys" / "stranger")
            stranger = federation.start_supernode(0, 2, "--auth-key", str(stranger_key), log="stranger.log")
            wrong_ca = start_a_supernode_trusting_another_ca(federation, tmp_path / "other")
            assert stranger.wait(seconds=120) == 2 and wrong_ca.wait(seconds=120) == 2
            training.wait(timeout=400)
        finally:
            training.kill()  # a no-op once it ended
            training.wait()
        logs = "".join((tmp_path / f).read_text()[-1500:] for f in ("train.log", "superlink.log", "supernode0.log"))
        assert training.returncode == 0, logs
    assert "its key is not registered" in (tmp_path / "stranger.log").read_text()
    assert "TLS verification failed" in (tmp_path / "wrong-ca.log").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and all(r["dropped"] == {} for r in records)
    assert (out / "observed/round-0002/client-01/features.safetensors").exists()
