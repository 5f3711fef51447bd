"""Ed25519 signer keys: ``PREFIX.key`` (PKCS#8 PEM, mode 0600) and ``PREFIX.pub`` (SubjectPublicKeyInfo PEM).

A key is pinned by its fingerprint: the sha256 of the raw 32-byte public key, lowercase hex. The
fingerprint is what campaigns, attestations (inside the signed campaign identity) and plans name.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core import atomic
from fq.core.canonical import sha256_hex
from fq.errors import FqError


def fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return sha256_hex(pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def key_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".key"), prefix.with_name(prefix.name + ".pub")


def generate(prefix: str | os.PathLike) -> tuple[Path, Path, str]:
    """Write a new key pair; refuses to replace an existing key (a lost signer key orphans a campaign)."""
    key = Ed25519PrivateKey.generate()
    priv_path, pub_path = write_pair(key, prefix)
    return priv_path, pub_path, fingerprint(key)


def write_pair(key, prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``PREFIX.key``, the private key's PKCS8 PEM (mode 600), and ``PREFIX.pub``, its public key's
    SubjectPublicKeyInfo PEM (644), each written atomically; refuses to replace an existing key."""
    priv_path, pub_path = key_paths(prefix)
    for p in (priv_path, pub_path):
        if os.path.lexists(p):
            raise FqError(f"{p}: already exists; refusing to overwrite a key")
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with atomic.atomic_open(priv_path, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(priv)
    with atomic.atomic_open(pub_path, "wb") as fh:
        os.fchmod(fh.fileno(), 0o644)
        fh.write(pub)
    return priv_path, pub_path


def _read(path: str | os.PathLike, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FqError(f"{path}: cannot read {what}: {e.strerror}") from None


def read_private(path: str | os.PathLike, what: str = "private key"):
    """The unencrypted PEM private key at ``path``, of any type, refused if group or others can read it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise FqError(f"{path}: cannot read {what}: {e.strerror}") from None
    if stat.S_IMODE(mode) & 0o077:
        raise FqError(f"{path}: private key is accessible by group/others (mode {stat.S_IMODE(mode):04o}); "
                      "run chmod 600 on it")
    try:
        return serialization.load_pem_private_key(_read(path, what), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise FqError(f"{path}: not an unencrypted PEM private key ({e})") from None


def load_private(path: str | os.PathLike) -> Ed25519PrivateKey:
    key = read_private(path)
    if not isinstance(key, Ed25519PrivateKey):
        raise FqError(f"{path}: expected an Ed25519 private key, got {type(key).__name__}")
    return key


def load_public(path: str | os.PathLike) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(_read(path, "public key"))
    except (ValueError, UnsupportedAlgorithm) as e:
        raise FqError(f"{path}: not a PEM public key ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise FqError(f"{path}: expected an Ed25519 public key, got {type(key).__name__}")
    return key
