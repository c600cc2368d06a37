"""A TLS-encrypted deployment on 127.0.0.1: `eftguard certs`, `eftguard superlink`, two `eftguard supernode`s
and `eftguard train --federation deployment`, run as a user would. Every process the test starts is stopped."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from eftguard.config import ConfigError
from eftguard.federation.deployment import check_tls_choice, connection_config

BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
EFTGUARD = [sys.executable, "-m", "eftguard.cli"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


class Processes:
    def __init__(self, folder):
        self.folder, self.started = folder, []

    def start(self, *args, log):
        process = subprocess.Popen([*EFTGUARD, *args], env={**ENV, "FLWR_HOME": str(self.folder)},
                                   stdout=open(self.folder / log, "w"), stderr=subprocess.STDOUT,
                                   start_new_session=True, cwd=self.folder)
        self.started.append(process)
        return process

    def stop_all(self):
        for process in self.started:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in self.started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)


def start_superlink(tmp_path, node_auth):
    subprocess.run([*EFTGUARD, "certs", "--out", str(tmp_path / "certs")], env=ENV, check=True, capture_output=True)
    port = free_port()
    processes = Processes(tmp_path)
    processes.start("superlink", "--certs", str(tmp_path / "certs"), "--port", str(port),
                    *(["--node-auth"] if node_auth else []), log="superlink.log")
    wait_for_port(port)
    return processes, port


@pytest.fixture
def tls_federation(tmp_path):
    processes, port = start_superlink(tmp_path, node_auth=False)
    yield processes, port, tmp_path
    processes.stop_all()


@pytest.fixture
def authenticated_federation(tmp_path):
    processes, port = start_superlink(tmp_path, node_auth=True)
    yield processes, port, tmp_path
    processes.stop_all()


def node_key(tmp_path, name, port=None):
    key = tmp_path / "keys" / name
    subprocess.run([*EFTGUARD, "node-key", "--out", str(key)], env=ENV, check=True, capture_output=True)
    if port is not None:
        subprocess.run([*EFTGUARD, "register-node", f"{key}.pub", "--superlink", f"127.0.0.1:{port}",
                        "--root-certificates", str(tmp_path / "certs" / "ca.crt")], env=ENV, check=True,
                       capture_output=True, timeout=60)
    return key


@pytest.mark.slow
@pytest.mark.parametrize("node_auth", [False, True], ids=["tls", "tls+node-auth"])
def test_eftvit_rounds_over_tls(tmp_path, node_auth):
    processes, port = start_superlink(tmp_path, node_auth)
    try:
        run_two_rounds(processes, port, tmp_path, node_auth)
    finally:
        processes.stop_all()


def run_two_rounds(processes, port, tmp_path, node_auth):
    ca = str(tmp_path / "certs" / "ca.crt")
    for k in range(2):
        auth = ["--auth-key", str(node_key(tmp_path, f"node{k}", port))] if node_auth else []
        processes.start("supernode", "--superlink", f"127.0.0.1:{port}", "--root-certificates", ca, "--partition",
                        str(k), "--clients", "2", "--port", str(free_port()), *auth, log=f"supernode{k}.log")
    out = tmp_path / "run"
    result = subprocess.run(
        [*EFTGUARD, "train", "--federation", "deployment", "--superlink", f"127.0.0.1:{port}", "--root-certificates",
         ca, "--out", str(out), "--clients", "2", "--rounds", "2", "--train-samples", "100", "--test-samples", "40",
         "--batch-size", "32"], env=ENV, capture_output=True, text=True, timeout=400)
    logs = "".join((tmp_path / f).read_text()[-1500:] for f in ("superlink.log", "supernode0.log"))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and all(r["dropped"] == {} for r in records)
    assert (out / "observed/round-0002/client-01/features.safetensors").exists()


@pytest.mark.slow
def test_supernode_with_another_ca_fails_fast(tls_federation):
    processes, port, tmp_path = tls_federation
    subprocess.run([*EFTGUARD, "certs", "--out", str(tmp_path / "other")], env=ENV, check=True, capture_output=True)
    start = time.monotonic()
    node = processes.start("supernode", "--superlink", f"127.0.0.1:{port}", "--root-certificates",
                           str(tmp_path / "other" / "ca.crt"), "--partition", "0", "--clients", "2",
                           "--port", str(free_port()), log="wrong-ca.log")
    code = node.wait(timeout=60)
    assert code == 2 and time.monotonic() - start < 30
    assert "TLS verification failed" in (tmp_path / "wrong-ca.log").read_text()


@pytest.mark.slow
def test_unregistered_supernode_is_refused(authenticated_federation):
    processes, port, tmp_path = authenticated_federation
    node_key(tmp_path, "registered", port)
    stranger = node_key(tmp_path, "stranger")
    node = processes.start("supernode", "--superlink", f"127.0.0.1:{port}", "--root-certificates",
                           str(tmp_path / "certs" / "ca.crt"), "--partition", "0", "--clients", "2",
                           "--port", str(free_port()), "--auth-key", str(stranger), log="stranger.log")
    assert node.wait(timeout=60) == 2
    assert "its key is not registered" in (tmp_path / "stranger.log").read_text()


def test_node_keys_are_openssh_ec_pairs(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from defenses.node_auth import write_node_key
    from defenses.tls import CertificateError

    private, public = write_node_key(tmp_path / "node")
    key = load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert load_ssh_public_key(public.read_bytes()) == key.public_key()
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(CertificateError, match="--force"):
        write_node_key(tmp_path / "node")


def test_certificates_are_a_proper_ca_and_server_pair(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from defenses.tls import CertificateError, write_certificates

    files = write_certificates(tmp_path, ("127.0.0.1", "fl.example.org"))
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    server.verify_directly_issued_by(ca)
    assert oct(files.server_key.stat().st_mode & 0o777) == "0o600" and oct(files.ca_key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(CertificateError, match="--force"):
        write_certificates(tmp_path)
    write_certificates(tmp_path, force=True)
    assert x509.load_pem_x509_certificate(files.ca_cert.read_bytes()) != ca


def test_tls_is_the_default_and_plaintext_must_be_asked_for(tmp_path, capsys):
    with pytest.raises(ConfigError, match="TLS is the default"):
        check_tls_choice(None, insecure=False)
    with pytest.raises(ConfigError, match="not both"):
        check_tls_choice(tmp_path, insecure=True)
    with pytest.raises(ConfigError, match="does not exist"):
        check_tls_choice(tmp_path / "missing.crt", insecure=False)
    check_tls_choice(None, insecure=True)
    assert "unencrypted" in capsys.readouterr().err


def test_connection_config_names_tls_or_plaintext(tmp_path):
    tls = tomllib.loads(connection_config("10.0.0.1:9093", tmp_path / "ca.crt", insecure=False))
    assert tls["superlink"]["default"] == "eftguard"
    assert tls["superlink"]["eftguard"] == {"address": "10.0.0.1:9093", "root-certificates": str(tmp_path / "ca.crt")}
    plain = tomllib.loads(connection_config("127.0.0.1:9093", None, insecure=True))
    assert plain["superlink"]["eftguard"]["insecure"] is True
