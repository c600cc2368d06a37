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


@pytest.fixture
def tls_federation(tmp_path):
    subprocess.run([*EFTGUARD, "certs", "--out", str(tmp_path / "certs")], env=ENV, check=True, capture_output=True)
    port = free_port()
    processes = Processes(tmp_path)
    try:
        processes.start("superlink", "--certs", str(tmp_path / "certs"), "--port", str(port), log="superlink.log")
        wait_for_port(port)
        yield processes, port, tmp_path
    finally:
        processes.stop_all()


@pytest.mark.slow
def test_eftvit_rounds_over_tls(tls_federation):
    processes, port, tmp_path = tls_federation
    ca = str(tmp_path / "certs" / "ca.crt")
    for k in range(2):
        processes.start("supernode", "--superlink", f"127.0.0.1:{port}", "--root-certificates", ca, "--partition",
                        str(k), "--clients", "2", "--port", str(free_port()), log=f"supernode{k}.log")
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
