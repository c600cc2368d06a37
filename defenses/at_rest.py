"""Encryption at rest of stored uploads: AES-256-GCM, one random nonce per file, the file's place in the
run directory as associated data (a ciphertext moved to another client's or round's slot fails to open)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from eftguard.paths import input_file_problem, read_text_file

KEY_BYTES = 32
KEY_FILE_LIMIT_BYTES = 4096  # 64 hex digits and a line break; a device or a pipe is refused before any read
NONCE_BYTES = 12
MAGIC = b"EFTG-AESGCM-1\n"


class AtRestError(ValueError):
    """A key is missing, malformed or wrong, or a file was tampered with."""


def create_key(path: Path) -> bytes:
    """A new random key in a new file (mode 0600); never overwrites."""
    key = AESGCM.generate_key(bit_length=8 * KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def read_key(path: Path) -> bytes:
    problem = input_file_problem(Path(path))  # missing, a folder, or a device or a pipe that would be read forever
    if problem is not None:
        raise AtRestError(f"key file {path} {problem}")
    try:
        key = bytes.fromhex(read_text_file(path, limit_bytes=KEY_FILE_LIMIT_BYTES).strip())
    except OSError as exc:  # unreadable, or far too long for a key
        raise AtRestError(f"key file {path} cannot be read ({exc.strerror or exc})") from None
    except ValueError:  # not hex, or not UTF-8 at all
        raise AtRestError(f"key file {path} is not a hex-encoded key") from None
    if len(key) != KEY_BYTES:
        raise AtRestError(f"key file {path} holds {len(key)} bytes, expected {KEY_BYTES}")
    return key


def fingerprint(key: bytes) -> str:
    """Names a key in the manifest without revealing it."""
    return hashlib.sha256(b"eftguard-key-fingerprint" + key).hexdigest()[:16]


def encrypt(key: bytes, plaintext: bytes, context: str) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return MAGIC + nonce + AESGCM(key).encrypt(nonce, plaintext, context.encode())


def decrypt(key: bytes, blob: bytes, context: str) -> bytes:
    if not blob.startswith(MAGIC):
        raise AtRestError(f"{context} is not an eftguard encrypted file")
    nonce = blob[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    try:
        return AESGCM(key).decrypt(nonce, blob[len(MAGIC) + NONCE_BYTES:], context.encode())
    except InvalidTag:
        raise AtRestError(f"{context} does not decrypt: wrong key, or the file was altered or moved") from None
