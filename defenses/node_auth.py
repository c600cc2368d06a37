"""SuperNode authentication keys: EC P-256 key pairs in OpenSSH format, as Flower's node auth expects.

The SuperLink (started with node auth) accepts only SuperNodes whose public key was registered through
its Control API; each SuperNode signs its requests with its private key."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from eftguard.defenses.tls import CertificateError
from eftguard.paths import output_file_problem


def write_node_key(path: Path, force: bool = False) -> tuple[Path, Path]:
    """Write PATH (private key, mode 0600) and PATH.pub (public key to register)."""
    private_path, public_path = Path(path), Path(f"{path}.pub")
    for existing in (private_path, public_path):
        if existing.is_dir():
            raise CertificateError(f"{existing} is a folder: give --out a file path for the node's key")
    problem = output_file_problem(private_path, "the node's key", makes_folders=True)
    if problem is not None:
        raise CertificateError(f"--out {path} {problem}")
    for existing in (private_path, public_path):
        if existing.exists() and not force:
            raise CertificateError(f"{existing} already exists: pass --force to replace it (then register the new key)")
    private_path.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    private_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                      serialization.NoEncryption())
    public_bytes = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    if private_path.exists():
        private_path.unlink()
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_bytes)
    public_path.write_bytes(public_bytes + b"\n")
    return private_path, public_path
