"""TLS certificates (defenses/tls.py), called directly. Each test is an accident or an attack on a file (a key
readable by others, a certificate a client should not trust). Fast enough for the mutation check of defenses/
(docs/mutation.md)."""

import datetime as dt
import ipaddress
import os
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from conftest import file_mode
from eftguard.defenses import tls
from eftguard.defenses.tls import CertificateError, issue_certificates, read_ca_certificates, write_certificates


NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


@pytest.fixture
def issued():
    """Function-scoped (milliseconds): the mutation check credits a module-scoped fixture to its first test only."""
    return issue_certificates(("fl.example.org", "10.0.0.5"), now=NOW)


def extension(certificate, kind):
    found = certificate.extensions.get_extension_for_class(kind)
    return found.value, found.critical


def names(certificate):
    return {(a.oid, a.value) for a in certificate.subject}


def test_ca_may_sign_certificates_and_nothing_else_for_ten_years(issued):
    ca_key, ca, _, _ = issued
    assert isinstance(ca_key.curve, ec.SECP256R1) and isinstance(ca.signature_hash_algorithm, hashes.SHA256)
    assert names(ca) == {(NameOID.ORGANIZATION_NAME, "eftguard"), (NameOID.COMMON_NAME, "eftguard CA")}
    assert ca.issuer == ca.subject and ca.public_key() == ca_key.public_key()
    assert (ca.not_valid_before_utc, ca.not_valid_after_utc) == (NOW - dt.timedelta(minutes=5),
                                                                 NOW + dt.timedelta(days=3650))
    assert extension(ca, x509.BasicConstraints) == (x509.BasicConstraints(ca=True, path_length=0), True)
    assert extension(ca, x509.KeyUsage) == (x509.KeyUsage(
        digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False), True)
    assert extension(ca, x509.SubjectKeyIdentifier) == (
        x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
    ca.verify_directly_issued_by(ca)


def test_server_certificate_is_a_signed_end_entity_for_the_given_names(issued):
    ca_key, ca, server_key, server = issued
    assert isinstance(server_key.curve, ec.SECP256R1) and isinstance(server.signature_hash_algorithm, hashes.SHA256)
    assert names(server) == {(NameOID.ORGANIZATION_NAME, "eftguard"), (NameOID.COMMON_NAME, "fl.example.org")}
    assert server.issuer == ca.subject and server.public_key() == server_key.public_key()
    assert server.serial_number != ca.serial_number
    assert (server.not_valid_before_utc, server.not_valid_after_utc) == (NOW - dt.timedelta(minutes=5),
                                                                         NOW + dt.timedelta(days=825))
    assert extension(server, x509.BasicConstraints) == (x509.BasicConstraints(ca=False, path_length=None), True)
    assert extension(server, x509.KeyUsage) == (x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=True, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False), True)
    assert extension(server, x509.ExtendedKeyUsage) == (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
    assert extension(server, x509.SubjectAlternativeName) == (x509.SubjectAlternativeName(
        [x509.DNSName("fl.example.org"), x509.IPAddress(ipaddress.ip_address("10.0.0.5"))]), False)
    assert extension(server, x509.AuthorityKeyIdentifier) == (
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False)
    server.verify_directly_issued_by(ca)


def test_server_common_name_is_cut_to_the_64_characters_x509_allows():
    long_name = ".".join(["a" * 63, "b" * 63])
    _, _, _, server = issue_certificates((long_name,), now=NOW)
    assert server.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == long_name[:64]


def test_certificates_are_valid_from_now_by_default():
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    _, ca, _, _ = issue_certificates(("127.0.0.1",))
    after = dt.datetime.now(dt.timezone.utc)
    assert before - dt.timedelta(minutes=5) <= ca.not_valid_before_utc <= after - dt.timedelta(minutes=5)


@pytest.fixture
def local_time_3_hours_ahead(monkeypatch):
    monkeypatch.setenv("TZ", "Etc/GMT-3")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_certificates_are_valid_now_on_a_machine_whose_clock_is_not_utc(local_time_3_hours_ahead):
    """A naive local time would be read as UTC: valid only from three hours from now."""
    _, ca, _, server = issue_certificates(("127.0.0.1",))
    now = dt.datetime.now(dt.timezone.utc)
    assert ca.not_valid_before_utc <= now and server.not_valid_before_utc <= now


def test_key_files_are_private_from_the_moment_they_are_created(tmp_path, monkeypatch):
    """Permissions are set when a file is created, not only afterwards by chmod (a reader could open it between)."""
    monkeypatch.setattr(os, "chmod", lambda path, mode: None)
    old_umask = os.umask(0o022)
    try:
        files = write_certificates(tmp_path)
    finally:
        os.umask(old_umask)
    assert [file_mode(p) for p in files.all()] == [0o644, 0o600, 0o644, 0o600]


@pytest.mark.parametrize("san, kind", [
    ("a" * 63 + ".example.org", x509.DNSName), (".".join(["a" * 61] * 4) + ".bcdef", x509.DNSName),
    ("node-1", x509.DNSName), ("1node", x509.DNSName), ("fe80::1", x509.IPAddress), ("10.0.0.5", x509.IPAddress),
])
def test_dns_names_of_rfc_1123_and_ip_addresses_are_accepted(san, kind):
    assert isinstance(tls._san(san), kind)


@pytest.mark.parametrize("san", ["a" * 64 + ".org", ".".join(["a" * 61] * 4) + ".bcdefg", "-node", "node-", "a..b",
                                 "fl.example.org:9092", "https://fl.example.org", "999.1.1.1", "node_1", ""])
def test_san_that_is_no_address_is_refused_before_any_key_is_made(tmp_path, san):
    message = (f"--san {san!r} is neither an IP address nor a DNS host name (dot-separated labels of letters, digits "
               "and inner hyphens; no scheme, path or port): give the address SuperNodes use, e.g. --san "
               "fl.example.org or --san 10.0.0.5")
    with pytest.raises(CertificateError) as refused:
        write_certificates(tmp_path / "certs", ("127.0.0.1", san))
    assert str(refused.value) == message and not (tmp_path / "certs").exists()


def test_certificate_names_keep_order_drop_repeats_and_add_loopback():
    assert tls.certificate_names(("b.org", "10.0.0.5", "b.org")) == ("b.org", "10.0.0.5", "127.0.0.1")
    assert tls.certificate_names(("127.0.0.1", "a.org")) == ("127.0.0.1", "a.org")


def test_written_files_are_named_as_flower_expects_keys_private_certificates_public(tmp_path):
    files = write_certificates(tmp_path / "new" / "certs", ("fl.example.org",))
    assert files.all() == tuple(tmp_path / "new" / "certs" / n for n in ("ca.crt", "ca.key", "server.pem", "server.key"))
    assert [file_mode(p) for p in files.all()] == [0o644, 0o600, 0o644, 0o600]
    ca_key = load_pem_private_key(files.ca_key.read_bytes(), None)
    [ca] = read_ca_certificates(files.ca_cert)
    assert ca.public_key() == ca_key.public_key()
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    assert server.public_key() == load_pem_private_key(files.server_key.read_bytes(), None).public_key()
    sans = extension(server, x509.SubjectAlternativeName)[0]
    assert sans.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def test_forced_rewrite_leaves_no_old_bytes_and_no_readable_key(tmp_path):
    files = write_certificates(tmp_path)
    files.server_cert.write_bytes(files.server_cert.read_bytes() * 3)  # longer than the new one
    os.chmod(files.server_key, 0o644)
    os.chmod(files.ca_cert, 0o600)
    write_certificates(tmp_path, force=True)
    assert len(x509.load_pem_x509_certificates(files.server_cert.read_bytes())) == 1
    assert [file_mode(p) for p in files.all()] == [0o644, 0o600, 0o644, 0o600]


@pytest.mark.parametrize("existing", ["ca.crt", "ca.key", "server.pem", "server.key"])
def test_existing_certificate_files_are_not_replaced_without_force(tmp_path, existing):
    (tmp_path / existing).write_text("in use\n")
    with pytest.raises(CertificateError, match=rf"^{tmp_path / existing} already exists: pass --force to replace the "
                                               r"certificates \(SuperNodes then need the new ca.crt\)$"):
        write_certificates(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [existing]


def test_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(CertificateError, match=f"^--out {tmp_path / 'out'} is a file: give a folder for the "
                                               "certificate files$"):
        write_certificates(tmp_path / "out")


@pytest.mark.parametrize("content, problem", [
    (None, "does not exist"), ("device", "is not a regular file"),  # /dev/zero, read whole, would never end
    (b"", r"is not a PEM CA certificate \(no PEM certificate in it\)"),
    (b"-----BEGIN CERTIFICATE-----\nxx\n", r"is not a PEM CA certificate \(no PEM certificate in it\)")])
def test_unreadable_ca_file_is_named_with_the_flag(tmp_path, content, problem):
    path = Path("/dev/zero") if content == "device" else tmp_path / "ca.crt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(CertificateError, match=rf"^--ca {path} {problem}: give the ca.crt written by eftguard certs$"):
        read_ca_certificates(path, "--ca")


def test_server_certificate_given_as_ca_is_refused(tmp_path):
    files = write_certificates(tmp_path)
    with pytest.raises(CertificateError, match=rf"^--root-certificates {files.server_cert} is an end-entity "
                                               "certificate, not a CA: give the ca.crt that signed the SuperLink's "
                                               "certificate, not server.pem$"):
        read_ca_certificates(files.server_cert)


def test_ca_bundle_without_basic_constraints_is_read_whole(tmp_path, issued):
    """Public root bundles hold old roots without basicConstraints: every certificate is kept."""
    ca_key, ca, _, _ = issued
    bare = (x509.CertificateBuilder().subject_name(ca.subject).issuer_name(ca.subject).public_key(ca_key.public_key())
            .serial_number(7).not_valid_before(NOW).not_valid_after(NOW + dt.timedelta(days=1))
            .sign(ca_key, hashes.SHA256()))
    (tmp_path / "bundle.crt").write_bytes(bare.public_bytes(Encoding.PEM) + ca.public_bytes(Encoding.PEM))
    assert read_ca_certificates(tmp_path / "bundle.crt") == [bare, ca]


def test_output_under_a_file_or_where_nothing_can_be_created_is_refused_before_any_key(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(CertificateError, match=f"^--out {tmp_path / 'out' / 'certs'} is under {tmp_path / 'out'}, "
                                               "which is a file: give a folder for the certificate files$"):
        write_certificates(tmp_path / "out" / "certs")
    with pytest.raises(CertificateError, match=r"^--out /proc/eftguard-certs: no file can be created there \(.+\): "
                                               "give a folder you can write to for the certificate files$"):
        write_certificates(Path("/proc/eftguard-certs"))


def test_ca_file_padded_past_the_limit_is_refused_whole(tmp_path):
    """A valid CA followed by megabytes is not read into memory for its first certificate."""
    files = write_certificates(tmp_path / "certs")
    path = tmp_path / "ca.crt"
    path.write_bytes(files.ca_cert.read_bytes() + b"\n" * tls.CERTIFICATE_LIMIT_BYTES)
    with pytest.raises(CertificateError, match=rf"^--root-certificates {path} is not a PEM CA certificate \({path} is "
                                               rf"over {tls.CERTIFICATE_LIMIT_BYTES} bytes\): give the ca.crt"):
        read_ca_certificates(path)


def ca_valid(ca_key, ca, start, end, serial):
    return (x509.CertificateBuilder().subject_name(ca.subject).issuer_name(ca.subject).public_key(ca_key.public_key())
            .serial_number(serial).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(ca_key, hashes.SHA256()))


@pytest.fixture
def clock_at(monkeypatch):
    """Sets the time tls reads as now (its validity checks), to the second."""
    def set_to(moment):
        monkeypatch.setattr(tls, "dt", type("dt", (), {"datetime": type("datetime", (), {
            "now": staticmethod(lambda tz=None: moment)}), "timezone": dt.timezone}))
    return set_to


def test_a_certificate_is_valid_through_both_ends_of_its_period_and_refused_a_second_outside(tmp_path, issued,
                                                                                              clock_at):
    """RFC 5280: the validity period includes notBefore and notAfter."""
    ca_key, ca, _, _ = issued
    end = NOW + dt.timedelta(days=1)
    path = tmp_path / "ca.crt"
    path.write_bytes(ca_valid(ca_key, ca, NOW, end, 11).public_bytes(Encoding.PEM))
    for moment in (NOW, end):
        clock_at(moment)
        assert len(read_ca_certificates(path)) == 1
    clock_at(end + dt.timedelta(seconds=1))
    with pytest.raises(CertificateError, match=rf"^--root-certificates {path} expired on 2026-01-03 03:04 UTC: "
                                               "recreate the certificates with eftguard certs --force$"):
        read_ca_certificates(path)
    clock_at(NOW - dt.timedelta(seconds=1))
    with pytest.raises(CertificateError, match=rf"^--root-certificates {path} is not valid before 2026-01-02 03:04 "
                                               "UTC: check this host's clock, or recreate the certificates with "
                                               "eftguard certs --force$"):
        read_ca_certificates(path)


def test_a_bundle_is_refused_only_when_every_root_is_outside_its_period_naming_the_first(tmp_path, issued, clock_at):
    ca_key, ca, _, _ = issued
    first = ca_valid(ca_key, ca, NOW, NOW + dt.timedelta(days=1), 21)
    second = ca_valid(ca_key, ca, NOW, NOW + dt.timedelta(days=2), 22)
    path = tmp_path / "bundle.crt"
    path.write_bytes(first.public_bytes(Encoding.PEM) + second.public_bytes(Encoding.PEM))
    clock_at(NOW + dt.timedelta(days=1, hours=1))  # the first expired, the second still valid
    assert read_ca_certificates(path) == [first, second]
    clock_at(NOW + dt.timedelta(days=3))
    with pytest.raises(CertificateError, match=rf"^--root-certificates {path} expired on 2026-01-03 03:04 UTC"):
        read_ca_certificates(path)
