"""The commands and node configuration `eftguard superlink` and `supernode` hand to Flower, built without starting
anything: TLS unless plaintext is asked for, certificates that name the Control address, node auth, and the node's
own settings. Fast enough for the mutation check of deployment.py (docs/mutation.md); tests/test_deployment.py
starts the processes."""

import math
import re
import sys
from pathlib import Path

import pytest

from defenses.tls import write_certificates
from eftguard.config import ConfigError
from eftguard.federation import deployment
from eftguard.federation.deployment import node_config, superlink_command, supernode_command


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
    write_certificates(tmp_path, ("10.0.0.5", "fl.example.org", "::1"))
    with pytest.raises(ConfigError, match=rf"does not name the Control address {re.escape(host)}: "
                                          rf"recreate the certificates with eftguard certs --san "):
        superlink_command(tmp_path, False, host, 9093)
    for named in ("fl.example.org", "[::1]", "10.0.0.5"):
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


def test_node_config_carries_the_nodes_own_settings(tmp_path):
    assert node_config(0, 2) == "partition-id=0 num-partitions=2 share-truth=false"
    ledger = tmp_path / "ledger folder"
    assert node_config(1, 2, noise_secret=0, share_truth=True, ledger_dir=ledger, max_epsilon=0.5) == (
        f'partition-id=1 num-partitions=2 share-truth=true noise-secret=0 ledger-dir="{ledger}" max-epsilon=0.5')


@pytest.mark.parametrize("changes, message", [
    ({"partition": 2}, r"^--partition must be between 0 and --clients - 1 \(1\), got 2$"),
    ({"partition": -1}, r"^--partition must be between 0 and --clients - 1 \(1\), got -1$"),
    ({"max_epsilon": 0.0}, r"^--max-epsilon must be a positive finite number, got 0.0$"),
    ({"max_epsilon": math.inf}, "got inf"), ({"max_epsilon": math.nan}, "got nan"),
    ({"ledger_dir": 'a"b'}, r"Flower's --node-config cannot carry a path with quotes or line breaks"),
    ({"ledger_dir": "a\nb"}, "cannot carry"), ({"ledger_dir": "a\rb"}, "cannot carry"),
])
def test_node_settings_flower_cannot_carry_are_refused(tmp_path, monkeypatch, changes, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        node_config(**{"partition": 0, "clients": 2, **changes})


def test_ledger_folder_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "ledger").write_text("x")
    with pytest.raises(ConfigError, match=rf"^--ledger-dir {tmp_path / 'ledger'} is a file: give a folder"):
        node_config(0, 2, ledger_dir=tmp_path / "ledger")


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


def test_a_port_other_processes_must_be_told_cannot_be_left_to_chance():
    with pytest.raises(ConfigError, match=r"^--port must be a fixed port \(1..65535\), not 0: other processes connect "
                                          r"to it$"):
        deployment.check_port_free("127.0.0.1", 0, "--port")
