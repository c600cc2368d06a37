"""Encryption at rest (defenses/at_rest.py), called directly. Each test is an accident or an attack on a file (a
moved ciphertext, a key readable by others). Fast enough for the mutation check of defenses/ (docs/mutation.md)."""

import hashlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conftest import file_mode
from eftguard.defenses import at_rest
from eftguard.defenses.at_rest import AtRestError, create_key, decrypt, encrypt, fingerprint, read_key


def test_new_key_is_32_random_bytes_in_a_file_only_its_owner_reads(tmp_path):
    key = create_key(tmp_path / "key")
    assert (tmp_path / "key").read_text() == key.hex() + "\n" and len(key) == 32
    assert file_mode(tmp_path / "key") == 0o600
    assert read_key(tmp_path / "key") == key != create_key(tmp_path / "other")


def test_creating_a_key_never_overwrites_one(tmp_path):
    key = create_key(tmp_path / "key")
    with pytest.raises(FileExistsError):
        create_key(tmp_path / "key")
    assert read_key(tmp_path / "key") == key


def test_key_file_with_surrounding_whitespace_reads(tmp_path):
    (tmp_path / "key").write_text("\n  " + "ab" * 32 + "  \n\n")
    assert read_key(tmp_path / "key") == bytes([0xAB]) * 32


@pytest.mark.parametrize("content, message", [
    (None, "key file {path} does not exist$"),
    ("folder", r"key file {path} is a folder$"),
    ("device", r"key file /dev/zero is not a regular file$"),  # read whole, it would never end
    ("zz-not-hex\n", "key file {path} is not a hex-encoded key$"),
    ("ab" * 16, "key file {path} holds 16 bytes, expected 32$"),
    ("ab" * 33, "key file {path} holds 33 bytes, expected 32$"),
])
def test_unusable_key_file_is_named_with_the_problem(tmp_path, content, message):
    path = Path("/dev/zero") if content == "device" else tmp_path / "key"
    if content == "folder":
        path.mkdir()
    elif content == "device":
        pass
    elif content is not None:
        path.write_text(content)
    with pytest.raises(AtRestError, match="^" + message.format(path=path)):
        read_key(path)


def test_key_file_padded_past_the_limit_is_refused_whole_not_read_for_its_key(tmp_path):
    """A valid key followed by megabytes of blanks is not a key file: reading it whole would let any file that ends
    in whitespace (a log, a device's dump) be read into memory before the check."""
    path = tmp_path / "key"
    path.write_text("ab" * 32 + " " * at_rest.KEY_FILE_LIMIT_BYTES)
    with pytest.raises(AtRestError, match=f"^key file {path} cannot be read "
                                          rf"\({path} is over {at_rest.KEY_FILE_LIMIT_BYTES} bytes\)$"):
        read_key(path)


def test_fingerprint_is_stable_and_reveals_nothing_of_the_key():
    """Manifests written earlier name their key by this value: it must not change between versions."""
    key = bytes(range(32))
    assert fingerprint(key) == "b5fbca4cc244da24"
    assert fingerprint(key) not in (key.hex(), hashlib.sha256(key).hexdigest()[:16])
    assert fingerprint(bytes(32)) != fingerprint(key)


def test_ciphertext_is_aes_gcm_with_a_fresh_nonce_bound_to_the_files_place():
    key, plaintext = bytes(range(32)), b"client 0's uploaded features"
    first, second = encrypt(key, plaintext, "round-1/client-0"), encrypt(key, plaintext, "round-1/client-0")
    header = len(at_rest.MAGIC)
    assert first[:header] == second[:header] == b"EFTG-AESGCM-1\n" and first[header:header + 12] != second[header:header + 12]
    assert AESGCM(key).decrypt(first[header:header + 12], first[header + 12:], b"round-1/client-0") == plaintext
    assert decrypt(key, first, "round-1/client-0") == decrypt(key, second, "round-1/client-0") == plaintext


@pytest.mark.parametrize("attack", ["moved", "wrong key", "altered", "nonce altered"])
def test_moved_altered_or_foreign_ciphertext_does_not_decrypt(attack):
    key = bytes(range(32))
    blob = bytearray(encrypt(key, b"truth", "round-1/client-0"))
    context = "round-1/client-1" if attack == "moved" else "round-1/client-0"
    if attack == "wrong key":
        key = bytes(32)
    if attack == "altered":
        blob[-1] ^= 1
    if attack == "nonce altered":
        blob[len(at_rest.MAGIC)] ^= 1
    with pytest.raises(AtRestError, match=f"^{context} does not decrypt: wrong key, or the file was altered or moved$"):
        decrypt(key, bytes(blob), context)


def test_file_that_is_not_ours_is_named():
    with pytest.raises(AtRestError, match="^round-1/client-0 is not an eftguard encrypted file$"):
        decrypt(bytes(32), b"EFTG-AESGCM-0\n" + bytes(40), "round-1/client-0")
