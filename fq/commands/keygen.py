"""``fq keygen --out PREFIX``: a new Ed25519 signer key pair (PREFIX.key mode 0600, PREFIX.pub)."""
from __future__ import annotations

from fq.provenance.attest import keys


def register(sub) -> None:
    p = sub.add_parser("keygen", help="write a new Ed25519 signer key pair",
                       description="Write PREFIX.key (PKCS#8 PEM, mode 0600) and PREFIX.pub; print the fingerprint "
                                   "(sha256 of the raw public key) that campaigns and consumers pin.")
    p.add_argument("--out", required=True, metavar="PREFIX", help="path prefix of the two key files")
    p.set_defaults(func=run)


def check_out(prefix: str) -> None:
    """Both key files can be written (a private key written and its public half refused would be half a pair);
    an existing key is refused by keys.generate."""
    from fq.core.paths import check_output_file
    from fq.errors import FqError

    try:
        paths = keys.key_paths(prefix)
    except ValueError:  # "", "/": no file name to add .key to
        raise FqError(f"--out {prefix!r}: expected a path prefix such as keys/signer") from None
    for p in paths:
        check_output_file(p, "--out")


def run(args) -> int:
    check_out(args.out)
    priv, pub, fp = keys.generate(args.out)
    print(f"private key: {priv}")
    print(f"public key:  {pub}")
    print(f"fingerprint: {fp}")
    return 0
