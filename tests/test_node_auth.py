"""SuperNode keys (defenses/node_auth.py), called directly: the key pair a node authenticates with, private from
the start and never silently replaced. Fast enough for the mutation check of defenses/ (docs/mutation.md)."""

import os

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from conftest import file_mode
from eftguard.defenses.node_auth import write_node_key
from eftguard.defenses.tls import CertificateError


def test_node_key_is_a_p256_openssh_pair_in_a_new_folder(tmp_path):
    private, public = write_node_key(tmp_path / "node-1" / "keys" / "node")
    assert (private, public) == (tmp_path / "node-1" / "keys" / "node", tmp_path / "node-1" / "keys" / "node.pub")
    assert private.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----") and file_mode(private) == 0o600
    key = load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key.curve, ec.SECP256R1)
    assert public.read_bytes().startswith(b"ecdsa-sha2-nistp256 ") and public.read_bytes().endswith(b"\n")
    assert load_ssh_public_key(public.read_bytes()) == key.public_key()


@pytest.mark.parametrize("existing", ["node", "node.pub"])
def test_node_key_refuses_to_replace_either_file_without_force(tmp_path, existing):
    (tmp_path / existing).write_bytes(b"registered\n")
    with pytest.raises(CertificateError, match=f"^{tmp_path / existing} already exists: pass --force to replace it "
                                               r"\(then register the new key\)$"):
        write_node_key(tmp_path / "node")
    assert [p.name for p in tmp_path.iterdir()] == [existing]


def test_forced_node_key_is_new_and_private_even_over_a_readable_file(tmp_path):
    private, public = write_node_key(tmp_path / "node")
    old = private.read_bytes()
    os.chmod(private, 0o644)
    write_node_key(tmp_path / "node", force=True)
    assert private.read_bytes() != old and file_mode(private) == 0o600
    assert load_ssh_public_key(public.read_bytes()) == load_ssh_private_key(private.read_bytes(), None).public_key()


@pytest.mark.parametrize("where", ["folder", "public folder", "under a file"])
def test_node_key_path_that_cannot_hold_a_file_is_refused_before_a_key_is_made(tmp_path, where):
    """--out names a file; a folder there (or at PATH.pub), or a file where a folder must be, is one line naming the
    path and what to give instead, and nothing is written."""
    if where == "folder":
        (tmp_path / "node").mkdir()
        out, message = tmp_path / "node", f"^{tmp_path / 'node'} is a folder: give --out a file path for the node's key$"
    elif where == "public folder":
        (tmp_path / "node.pub").mkdir()
        out, message = tmp_path / "node", f"^{tmp_path / 'node.pub'} is a folder: give --out a file path"
    else:
        (tmp_path / "keys").write_text("a file\n")
        out = tmp_path / "keys" / "node"
        message = (f"^--out {out} is under {tmp_path / 'keys'}, which is a file: give a path in a folder for "
                   "the node's key$")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CertificateError, match=message):
        write_node_key(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
