"""Running the apps on a deployed Flower federation: the SuperLink and SuperNode processes, and `flwr run`.

The ServerApp runs where the SuperLink runs and writes the run directory there, so start
`eftguard train --federation deployment` on the SuperLink's host. Each SuperNode serves one data
partition (node config "partition-id=K num-partitions=N"). TLS is the default everywhere; plaintext
only with an explicit --insecure.

`eftguard superlink` runs Flower's SuperLink on loopback (its Control and Runtime APIs have no account
authentication) and exposes only the Fleet API on --host/--port, through eftguard.federation.fleet_gateway.
`eftguard train` and `register-node` therefore talk to the Control address, 127.0.0.1:9093 by default.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import math
import os
import queue
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import MISSING, dataclass
from pathlib import Path

from cryptography import x509

from eftguard.defenses.tls import CertificateFiles, check_valid_now, is_host_name, read_ca_certificates
from eftguard.device import resolve_device
from eftguard.errors import ConfigError, FederationError
from eftguard.options import option
from eftguard.paths import file_in_the_way, input_file_problem, unwritable_reason
from eftguard.rundir import RunDirectory

APP_DIR = Path(__file__).parent / "flwr_app"
PLAINTEXT_HELP = "plaintext instead of TLS (trusted networks only)"
CA_HELP = "CA that signed the SuperLink's certificate"


# --- the options of the deployment commands, declared once (eftguard.options): argparse is generated from them --

@dataclass(frozen=True)
class CertsOptions:
    """eftguard certs."""

    out: Path = option(MISSING, "folder for the certificate files")
    san: tuple[str, ...] | None = option(None, "IP address or DNS host name SuperNodes use to reach the SuperLink; "
                                               "repeat for several (default: 127.0.0.1, localhost, ::1). "
                                               "127.0.0.1 is always added: eftguard train and register-node reach "
                                               "the Control API there", metavar="HOST_OR_IP", repeated=True)
    force: bool = option(False, "replace existing certificate files")


@dataclass(frozen=True)
class TrainDeploymentOptions:
    """eftguard train --federation deployment's flags (not stored in config.toml)."""

    superlink: str | None = option(None, "address of the running SuperLink", metavar="HOST:PORT",
                                   check=lambda address: check_address(address))  # defined below
    root_certificates: Path | None = option(None, "CA certificate that signed the SuperLink's TLS certificate (TLS "
                                                  "is the default)", metavar="CA.crt")
    insecure: bool = option(False, "plaintext gRPC/HTTP instead of TLS (trusted networks only)")


@dataclass(frozen=True)
class SuperLinkOptions:
    """eftguard superlink."""

    certs: Path | None = option(None, "folder written by eftguard certs")
    insecure: bool = option(False, PLAINTEXT_HELP)
    host: str = option("127.0.0.1", "address the Fleet API listens on (0.0.0.0 for SuperNodes on other hosts)")
    port: int = option(9092, "Fleet API port (0: any free port, printed at start)")
    control_host: str = option("127.0.0.1", "address of the Control API (eftguard train, register-node, flwr ls). "
                                            "Anyone who reaches it can register node keys and start runs: keep the "
                                            "default 127.0.0.1")
    control_port: int = option(9093, "Control API port")
    node_auth: bool = option(False, "accept only SuperNodes whose key was registered with eftguard register-node")


@dataclass(frozen=True)
class NodeKeyOptions:
    """eftguard node-key."""

    out: Path = option(MISSING, "path of the private key", metavar="KEY")
    force: bool = option(False, "replace an existing key")


@dataclass(frozen=True)
class RegisterNodeOptions:
    """eftguard register-node."""

    public_key: Path = option(MISSING, "the SuperNode's public key (eftguard node-key writes KEY.pub)",
                              metavar="KEY.pub", positional=True)
    superlink: str = option("127.0.0.1:9093", "the SuperLink's Control address", metavar="HOST:PORT")
    root_certificates: Path | None = option(None, CA_HELP, metavar="CA.crt")
    insecure: bool = option(False, PLAINTEXT_HELP)


@dataclass(frozen=True)
class SuperNodeOptions:
    """eftguard supernode."""

    superlink: str = option(MISSING, "the SuperLink's Fleet address (eftguard superlink --host/--port)",
                            metavar="HOST:PORT")
    partition: int = option(MISSING, "data partition this node serves (0..N-1)")
    clients: int = option(MISSING, "N: partitions in the federation (--clients of the run)")
    root_certificates: Path | None = option(None, CA_HELP, metavar="CA.crt")
    insecure: bool = option(False, PLAINTEXT_HELP)
    port: int | None = option(None, "local port of this SuperNode, on 127.0.0.1; each SuperNode on one host needs "
                                    "its own (default: 9100 + partition)")
    auth_key: Path | None = option(None, "private key from eftguard node-key (for a SuperLink with --node-auth)",
                                   metavar="KEY")
    noise_secret: int | None = option(None, "an integer only this node knows, mixed into the seeds of its DP noise, "
                                            "batches and masks, so the server (which knows the run seed) cannot "
                                            "regenerate them", metavar="N")
    share_truth: bool = option(False, "send the server auditor-only ground truth (source sample ids, kept patches, "
                                      "class counts) when a run asks for it (--record-truth). It reveals this node's "
                                      "class histogram: only for a server that is your own auditor (default: off)")
    ledger_dir: Path | None = option(None, "folder of this node's privacy ledger: the epsilon it has spent per run, "
                                           "which it checks before every round whatever the server says (default: "
                                           "$EFTGUARD_HOME/ledger, EFTGUARD_HOME defaulting to ~/.eftguard)",
                                     metavar="DIR")
    model_check: bool = option(True, "check every model and the settings the server sends and refuse (upload "
                                     "nothing for) a round whose model honest training cannot have produced from the "
                                     "run's initial model and the last model this node accepted (a malicious "
                                     "server's crafted weights), or whose settings changed mid-run")
    initial_model: Path | None = option(None, "this node's copy of the checkpoint the run starts from (--checkpoint "
                                              "of eftguard train): the model check rebuilds the run's initial model "
                                              "from it. Without it the node rebuilds the seeded initialisation of "
                                              "the run's configuration, so a run from a checkpoint is refused in "
                                              "round 1", metavar="CKPT")
    trust_first_model: bool = option(False, "anchor the model check on the first model the server sends instead of "
                                            "rebuilding the initial model (trust on first use: a crafted first model "
                                            "that passes the structural checks is then accepted)")
    max_epsilon: float | None = option(None, "this node's own privacy ceiling per run: it refuses any round that "
                                             "would take its spend above E (or above the first --dp-eps the server "
                                             "declared, if lower); default: the server's first --dp-eps",
                                       metavar="E")


TLS_FAILURE_MARKERS = ("CERTIFICATE_VERIFY_FAILED", "SSL/TLS handshake error", "certificate verify failed")


def flower_executable(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise FederationError(f"the `{name}` command is missing: reinstall eftguard (pip install -e .)")
    return found


def flower_env(**extra: str) -> dict[str, str]:
    """Flower's processes start further Flower commands from PATH: put this environment's first (with PATH unset,
    before the system default: an empty entry would mean the current folder).
    (Telemetry and update checks are already off: eftguard.cli.main sets that for the whole process.)"""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
    return {**os.environ, "PATH": path, **extra}


def check_tls_choice(root_certificates: Path | None, insecure: bool, flag: str = "--root-certificates") -> None:
    if insecure and root_certificates:
        raise ConfigError(f"choose either --insecure or {flag}, not both")
    if not insecure and not root_certificates:
        raise ConfigError(f"TLS is the default: pass {flag} (or --insecure for plaintext on a trusted network)")
    if root_certificates and not Path(root_certificates).exists():  # a file (SuperNode) or a folder (SuperLink)
        raise ConfigError(f"{flag} {root_certificates} does not exist (create certificates with eftguard certs)")
    if root_certificates and flag == "--root-certificates":
        read_ca_certificates(Path(root_certificates), flag)
    if insecure:
        print("eftguard: warning: --insecure: uploads travel unencrypted", file=sys.stderr)


def check_address(address: str, flag: str = "--superlink") -> None:
    """HOST:PORT as Flower reads it (HOST an IP address, [IPv6] or a host name; PORT in 1..65535), refused in one
    line before any process starts: Flower retries an address it cannot reach forever."""
    host, colon, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    inner = unbracketed(host)  # one pair of brackets: "[127.0.0.1" or "[[::1]" is no host
    try:
        ipaddress.ip_address(inner)
        valid_host = bracketed == (":" in inner)  # an IPv6 address in brackets, any other without
    except ValueError:
        valid_host = not bracketed and is_host_name(inner)
    if not (colon and valid_host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{flag} {address!r} is not HOST:PORT (an IP address, [IPv6 address] or host name, and a "
                          "port in 1..65535), e.g. 127.0.0.1:9092")


def unbracketed(host: str) -> str:
    """The address inside one pair of brackets ("[::1]" -> "::1"), as sockets and certificates name it."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(unbracketed(host)).is_loopback
    except ValueError:
        return host == "localhost"


def bind_listener(host: str, port: int, flag: str) -> socket.socket:
    """A listening socket on host:port (port 0: any free port), or a one-line error naming `flag`.
    Flower itself reports a taken port only as a traceback after it has started."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag} {port} is not a port number (0..65535)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(unbracketed(host), port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise ConfigError(f"{host} is not an address of this host: check --host / --control-host") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
    try:
        listener.bind(address)
        listener.listen(128)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{flag} {port} is already in use on {host} (another SuperLink or SuperNode?): "
                              f"give each process on this host its own {flag}") from None
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): check {flag} and the host") from None
    return listener


def check_port_free(host: str, port: int, flag: str) -> None:
    """For ports that Flower binds itself: they must be fixed, as other processes are told them."""
    if port == 0:
        raise ConfigError(f"{flag} must be a fixed port (1..65535), not 0: other processes connect to it")
    bind_listener(host, port, flag).close()


def superlink_command(certs: Path | None, insecure: bool, control_host: str, control_port: int,
                      node_auth: bool = False) -> list[str]:
    """flower-superlink bound to the Control address; all its APIs (Fleet, Control, Runtime) listen there."""
    command = [flower_executable("flower-superlink"), "--host", control_host, "--port", str(control_port),
               "--disable-runtime-dependency-installation"] + (["--enable-supernode-auth"] if node_auth else [])
    if insecure:
        return command + ["--insecure"]

    files = CertificateFiles(Path(certs))
    for needed in (files.ca_cert, files.server_cert, files.server_key):
        if not needed.is_file():
            raise ConfigError(f"{needed} is missing: create certificates with eftguard certs --out {certs}")
    read_ca_certificates(files.ca_cert, "--certs")
    _check_names_control_host(files.server_cert, control_host)
    return command + ["--ssl-ca-certfile", str(files.ca_cert), "--ssl-certfile", str(files.server_cert),
                      "--ssl-keyfile", str(files.server_key)]


def _check_names_control_host(server_cert: Path, control_host: str) -> None:
    """`flwr run` and Flower's SuperExec verify the certificate against the Control address, and every client
    against the time: an expired one is refused here, not served."""
    try:
        certificate = x509.load_pem_x509_certificate(server_cert.read_bytes())
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        raise ConfigError(f"{server_cert} is not a server certificate from eftguard certs: recreate it") from None
    check_valid_now(certificate, str(server_cert))
    addresses = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    if unbracketed(control_host) not in addresses | set(names.get_values_for_type(x509.DNSName)):
        raise ConfigError(f"{server_cert} does not name the Control address {control_host}: recreate the "
                          f"certificates with eftguard certs --san {control_host} ... --force")


def run_superlink(command: list[str], listener: socket.socket, control_host: str, control_port: int,
                  certs: Path | None) -> int:
    """Run Flower's SuperLink on the Control address and the Fleet gateway on `listener` until either stops
    (certs None: plaintext). Prints one line `eftguard: Fleet API ... Control API ...` once both accept
    connections."""
    # the Fleet gateway's web stack (0.2 s): the SuperLink alone serves it
    import httpx
    import uvicorn

    from eftguard.federation.fleet_gateway import fleet_gateway

    files = CertificateFiles(Path(certs)) if certs else None
    flower = subprocess.Popen(command, env=flower_env())
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        _wait_until_listening(flower, control_host, control_port)
        control = f"{_bracketed(control_host)}:{control_port}"
        upstream = httpx.AsyncClient(base_url=f"{'https' if files else 'http'}://{control}", timeout=120,
                                     verify=ssl.create_default_context(cafile=str(files.ca_cert)) if files else False)
        gateway = uvicorn.Server(uvicorn.Config(fleet_gateway(upstream), log_level="warning", lifespan="on",
                                                ssl_certfile=str(files.server_cert) if files else None,
                                                ssl_keyfile=str(files.server_key) if files else None))
        threading.Thread(target=lambda: (flower.wait(), setattr(gateway, "should_exit", True)), daemon=True).start()
        fleet_host, fleet_port = listener.getsockname()[:2]
        print(f"eftguard: Fleet API for SuperNodes on {_bracketed(fleet_host)}:{fleet_port}; Control API for "
              f"eftguard train and register-node on {control} only", file=sys.stderr, flush=True)
        gateway.run(sockets=[listener])  # returns on SIGINT/SIGTERM (re-raised after) or when Flower stopped
        if flower.poll() is not None:
            raise FederationError(f"flower-superlink stopped (exit code {flower.returncode}); see its log above")
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        listener.close()
        _stop(flower)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _wait_until_listening(process: subprocess.Popen, host: str, port: int, seconds: float = 120) -> None:
    """Flower's SuperLink prints no machine-readable ready signal: wait until its port accepts a connection."""
    deadline = time.monotonic() + seconds
    while process.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection((unbracketed(host), port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    if process.poll() is not None:
        raise FederationError(f"flower-superlink stopped while starting (exit code {process.returncode}); "
                              "see its log above")
    raise FederationError(f"flower-superlink did not open {host}:{port} within {seconds:.0f} s; see its log above")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def node_config(partition: int, clients: int, noise_secret: int | None = None, share_truth: bool = False,
                ledger_dir: Path | None = None, max_epsilon: float | None = None, model_check: bool = True,
                initial_model: Path | None = None, trust_first_model: bool = False, device: str = "cpu") -> str:
    """The --node-config string of a SuperNode (keys: see the node's ClientApp in eftguard.federation.apps). device
    (--device) is resolved here, on the node's host, where its ClientApp trains: auto becomes cuda or cpu, and a GPU
    torch does not find is refused before the node starts."""
    if not 0 <= partition < clients:
        raise ConfigError(f"--partition must be between 0 and --clients - 1 ({clients - 1}), got {partition}")
    entries = [f"partition-id={partition}", f"num-partitions={clients}", f"share-truth={str(share_truth).lower()}"]
    if noise_secret is not None:
        entries.append(f"noise-secret={noise_secret}")
    if ledger_dir is not None:
        ledger_dir = Path(ledger_dir).expanduser().resolve()
        blocker = file_in_the_way(ledger_dir)
        if blocker is not None:
            where = "is a file" if blocker == ledger_dir else f"is under {blocker}, which is a file"
            raise ConfigError(f"--ledger-dir {ledger_dir} {where}: give a folder for the node's privacy ledger")
        reason = unwritable_reason(ledger_dir)
        if reason is not None:  # else every round would fail on the node, which records its spending before it uploads
            raise ConfigError(f"--ledger-dir {ledger_dir}: no file can be created there ({reason}): give a folder "
                              "you can write to for the node's privacy ledger")
        entries.append(f"ledger-dir={_config_path('--ledger-dir', ledger_dir)}")
    if max_epsilon is not None:
        if not (math.isfinite(max_epsilon) and max_epsilon > 0):
            raise ConfigError(f"--max-epsilon must be a positive finite number, got {max_epsilon}")
        entries.append(f"max-epsilon={max_epsilon!r}")
    entries.append(f"model-check={str(model_check).lower()}")
    if initial_model is not None:
        if trust_first_model:
            raise ConfigError("--initial-model and --trust-first-model exclude each other: the node rebuilds the "
                              "run's initial model from the file, or trusts the first model it receives")
        problem = input_file_problem(Path(initial_model))
        if problem is not None:
            raise ConfigError(f"--initial-model {initial_model} {problem}: give the node's copy of the checkpoint "
                              "the run starts from")
        entries.append(f"initial-model={_config_path('--initial-model', Path(initial_model).resolve())}")
    if trust_first_model:
        entries.append("trust-first-model=true")
    entries.append(f"device={json.dumps(str(resolve_device(device)))}")
    return " ".join(entries)


def _config_path(flag: str, path: Path) -> str:
    if any(c in str(path) for c in '"\n\r'):
        raise ConfigError(f"{flag} {str(path)!r}: Flower's --node-config cannot carry a path with quotes or line "
                          "breaks; choose another place")
    return json.dumps(str(path))


def supernode_command(superlink: str, root_certificates: Path | None, insecure: bool, port: int, config: str,
                      auth_key: Path | None = None) -> list[str]:
    check_address(superlink)
    check_port_free("127.0.0.1", port, "--port")
    command = [flower_executable("flower-supernode"), "--superlink", superlink, "--port", str(port),
               "--node-config", config]
    if auth_key:
        problem = input_file_problem(auth_key)
        if problem is not None:
            raise ConfigError(f"--auth-key {auth_key} {problem} (create one with eftguard node-key)")
        command += ["--auth-supernode-private-key", str(auth_key)]
    return command + (["--insecure"] if insecure else ["--root-certificates", str(root_certificates)])


SUPERNODE_FAILURES = (
    (TLS_FAILURE_MARKERS, "TLS verification failed: the SuperLink's certificate is not signed by the CA given as "
                          "--root-certificates, or does not name the address in --superlink (see eftguard certs --san)"),
    (("Failed to activate SuperNode",), "the SuperLink refused this SuperNode: its key is not registered "
                                        "(eftguard register-node KEY.pub on the SuperLink's side)"),
    (("address already in use",), "--port is already in use on this host (another SuperNode?): give each "
                                  "SuperNode on one host its own --port"),
)
# A traceback through this frame ended the SuperNode's main thread; its HTTP thread keeps the process alive.
MAIN_THREAD_FRAME = 'flower-supernode", line'


def run_supernode(command: list[str]) -> int:
    """Run a SuperNode, passing its log through; stop at once with a clear error when the SuperLink cannot be
    trusted (TLS), does not accept this node (auth), or the SuperNode's main thread died (Flower would hang)."""
    # errors="replace": one undecodable byte would end the reader thread and leave this wrapper waiting forever.
    process = subprocess.Popen(command, env=flower_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    # SIGTERM must unwind through `finally`, or the SuperNode's own process group outlives this wrapper.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        check = SupernodeLogCheck()
        while (line := lines.get()) is not None:
            sys.stderr.write(line)
            check(line)
        return process.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop_group(process)


class SupernodeLogCheck:
    """Reads a SuperNode's log line by line; raises FederationError on a failure it cannot recover from."""

    def __init__(self) -> None:
        self.previous, self.main_thread_died = "", False

    def __call__(self, line: str) -> None:
        for markers, message in SUPERNODE_FAILURES:
            if any(marker in line for marker in markers):
                raise FederationError(message)
        if self.previous.startswith("Traceback (most recent call last):") and MAIN_THREAD_FRAME in line:
            self.main_thread_died = True
        elif self.main_thread_died and line.strip() and not line[0].isspace():
            raise FederationError(f"the SuperNode stopped on an error it cannot recover from: {line.strip()} "
                                  "(see its log above)")
        self.previous = line


def _stop_group(process: subprocess.Popen) -> None:
    """Stop the SuperNode and the processes it started (SuperExec, ClientApps)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def connection_config(superlink: str, root_certificates: Path | None, insecure: bool) -> str:
    """The FLWR_HOME config.toml naming the SuperLink connection `eftguard`."""
    lines = ['[superlink]', 'default = "eftguard"', '', '[superlink.eftguard]', f'address = {json.dumps(superlink)}']
    if insecure:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {json.dumps(str(Path(root_certificates).resolve()))}")
    return "\n".join(lines) + "\n"


def register_node(public_key: Path, superlink: str, root_certificates: Path | None, insecure: bool) -> None:
    """Register a SuperNode's public key with a SuperLink started with node auth (flwr supernode register)."""
    check_address(superlink)
    check_tls_choice(root_certificates, insecure)
    problem = input_file_problem(public_key)
    if problem is not None:
        raise ConfigError(f"public key {public_key} {problem} (eftguard node-key writes KEY and KEY.pub)")
    with tempfile.TemporaryDirectory(prefix="eftguard-flwr-") as home:
        (Path(home) / "config.toml").write_text(connection_config(superlink, root_certificates, insecure))
        result = subprocess.run([flower_executable("flwr"), "supernode", "register", str(public_key), "eftguard"],
                                env=flower_env(FLWR_HOME=home), capture_output=True, text=True,
                                errors="replace")
    if result.returncode != 0:
        raise FederationError(f"registering {public_key} failed: {(result.stdout + result.stderr).strip()[-500:]}")
    print(result.stdout.strip())


def run_deployed(run_dir: Path, superlink: str | None, root_certificates: Path | None, insecure: bool,
                 device: str = "cpu") -> None:
    """Run the run's rounds on the SuperLink with `flwr run`. The ServerApp (θ training, evaluation) computes on device
    (eftguard train's --device, resolved on this host, where the SuperLink starts the ServerApp): carried as the run
    config key "device" beside "run-dir", so config.toml stays free of devices."""
    if not superlink:
        raise ConfigError("--federation deployment needs --superlink HOST:PORT (the SuperLink's address)")
    check_tls_choice(root_certificates, insecure)
    run = RunDirectory.open(run_dir)
    rounds = run.config().rounds
    with tempfile.TemporaryDirectory(prefix="eftguard-flwr-") as home:
        (Path(home) / "config.toml").write_text(connection_config(superlink, root_certificates, insecure))
        env = flower_env(FLWR_HOME=home)
        command = [flower_executable("flwr"), "run", str(APP_DIR), "eftguard", "--stream",
                   "-c", f"run-dir={json.dumps(str(Path(run_dir).resolve()))} device={json.dumps(str(device))}"]
        result = subprocess.run(command, env=env)
    done = run.completed_rounds()
    if done < rounds:
        hint = (" --superlink must be the SuperLink's Control address (127.0.0.1:9093 unless eftguard superlink "
                "was given --control-port), not the Fleet address SuperNodes use.")
        if not insecure:
            hint += (" If the SuperLink was reported unavailable, check that --root-certificates is the CA that "
                     "signed the SuperLink's certificate (TLS).")
        raise FederationError(f"the deployed run stopped after round {done} of {rounds} (flwr exit code "
                              f"{result.returncode}); see the output above.{hint} Continue with "
                              f"eftguard train --resume {run_dir} --superlink {superlink} ...")
