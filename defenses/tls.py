"""Certificates for a TLS-encrypted Flower deployment: a private CA and a server certificate.

EC P-256 keys. The CA certificate is a CA (basicConstraints CA:TRUE, pathlen 0) that may only sign
certificates and CRLs; the server certificate is an end-entity serverAuth certificate whose subject
alternative names list every address the SuperNodes use to reach the SuperLink.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from eftguard.paths import file_in_the_way, input_file_problem, read_file_bytes, unwritable_reason

LOOPBACK = "127.0.0.1"
DEFAULT_SANS = (LOOPBACK, "localhost", "::1")
CERTIFICATE_LIMIT_BYTES = 2 ** 20  # a CA bundle is a few KiB; a device or a pipe is refused before any read
CA_DAYS, SERVER_DAYS = 3650, 825


class CertificateError(ValueError):
    """Certificates could not be written; the message says how to fix it."""


@dataclass(frozen=True)
class CertificateFiles:
    """The files `eftguard certs` writes, named as Flower's TLS flags expect them."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.folder / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.folder / "server.key"

    def all(self) -> tuple[Path, ...]:
        return self.ca_cert, self.ca_key, self.server_cert, self.server_key


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "eftguard"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def is_host_name(entry: str) -> bool:
    """A DNS host name by RFC 1123, whose last label is not all digits (that is a mistyped IP address)."""
    labels = entry.split(".")
    return len(entry) <= 253 and all(DNS_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def _san(entry: str) -> x509.GeneralName:
    """An IP address, or a DNS host name (is_host_name: letters, digits, hyphens; labels of 1-63 characters)."""
    try:
        return x509.IPAddress(ipaddress.ip_address(entry))
    except ValueError:
        pass
    if not is_host_name(entry):
        raise CertificateError(f"--san {entry!r} is neither an IP address nor a DNS host name (dot-separated labels "
                               "of letters, digits and inner hyphens; no scheme, path or port): give the address "
                               "SuperNodes use, e.g. --san fl.example.org or --san 10.0.0.5")
    return x509.DNSName(entry)


def read_ca_certificates(path: Path, flag: str = "--root-certificates") -> list[x509.Certificate]:
    """The CA certificates in a PEM file, at least one of them within its validity period. Flower reads this file
    only once it has started, and then hangs after an ssl.SSLError: check it before starting anything."""
    problem = input_file_problem(Path(path))  # missing, a folder, or a device or a pipe that would be read forever
    if problem is not None:
        raise CertificateError(f"{flag} {path} {problem}: give the ca.crt written by eftguard certs")
    try:
        certificates = x509.load_pem_x509_certificates(read_file_bytes(path, limit_bytes=CERTIFICATE_LIMIT_BYTES))
    except (OSError, ValueError) as exc:
        reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else "no PEM certificate in it"
        raise CertificateError(f"{flag} {path} is not a PEM CA certificate ({reason}): give the ca.crt written "
                               "by eftguard certs") from None
    outside = []
    for certificate in certificates:
        try:
            check_valid_now(certificate, f"{flag} {path}")
        except CertificateError as exc:
            outside.append(exc)
        try:
            if not certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
                raise CertificateError(f"{flag} {path} is an end-entity certificate, not a CA: give the ca.crt "
                                       "that signed the SuperLink's certificate, not server.pem")
        except x509.ExtensionNotFound:
            pass
    if len(outside) == len(certificates):  # a bundle may hold expired roots beside valid ones: not all of them
        raise outside[0]
    return certificates


def check_valid_now(certificate: x509.Certificate, named: str) -> None:
    """Refuse a certificate outside its validity period: a SuperLink would serve it and every client refuse it
    (or, verifying nothing, accept it)."""
    now = dt.datetime.now(dt.timezone.utc)
    if now > certificate.not_valid_after_utc:
        raise CertificateError(f"{named} expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: recreate "
                               "the certificates with eftguard certs --force")
    if now < certificate.not_valid_before_utc:
        raise CertificateError(f"{named} is not valid before {certificate.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: "
                               "check this host's clock, or recreate the certificates with eftguard certs --force")


def issue_certificates(sans: tuple[str, ...] = DEFAULT_SANS, now: dt.datetime | None = None):
    """(ca_key, ca_cert, server_key, server_cert) objects."""
    alternative_names = [_san(s) for s in sans]  # before any key is made
    now = now or dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("eftguard CA")).issuer_name(_name("eftguard CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(sans[0][:64])).issuer_name(ca_cert.subject)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert, server_key, server_cert


def _write(path: Path, data: bytes, private: bool) -> None:
    """Keys are created with mode 0600 from the start, never readable by others even briefly."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600 if private else 0o644)


def certificate_names(sans: tuple[str, ...]) -> tuple[str, ...]:
    """The requested SANs in order without repeats, and 127.0.0.1: `eftguard train` and `register-node` reach the
    SuperLink's Control API on loopback (see eftguard.federation.deployment)."""
    return tuple(dict.fromkeys((*sans, LOOPBACK)))


def write_certificates(folder: Path, sans: tuple[str, ...] = DEFAULT_SANS, force: bool = False) -> CertificateFiles:
    files = CertificateFiles(Path(folder))
    blocker = file_in_the_way(files.folder)
    if blocker is not None:
        where = "is a file" if blocker == files.folder else f"is under {blocker}, which is a file"
        raise CertificateError(f"--out {folder} {where}: give a folder for the certificate files")
    reason = unwritable_reason(files.folder)
    if reason is not None:
        raise CertificateError(f"--out {folder}: no file can be created there ({reason}): give a folder you can write "
                               "to for the certificate files")
    existing = [p for p in files.all() if p.exists()]
    if existing and not force:
        raise CertificateError(f"{existing[0]} already exists: pass --force to replace the certificates "
                               "(SuperNodes then need the new ca.crt)")
    ca_key, ca_cert, server_key, server_cert = issue_certificates(certificate_names(sans))  # checks every SAN first
    files.folder.mkdir(parents=True, exist_ok=True)
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    _write(files.ca_cert, ca_cert.public_bytes(pem), private=False)
    _write(files.server_cert, server_cert.public_bytes(pem), private=False)
    _write(files.ca_key, ca_key.private_bytes(pem, pkcs8, serialization.NoEncryption()), private=True)
    _write(files.server_key, server_key.private_bytes(pem, pkcs8, serialization.NoEncryption()), private=True)
    return files
