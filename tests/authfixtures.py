"""Generate real credentials for auth tests: nkeys, NATS JWTs/.creds files, a TLS PKI.

Nothing here talks to a server; the outputs are fed to
:class:`airflow_nats_ordered.embedded.servers.NatsServer`
as config text and to the client as files. All key material is freshly generated per
call, so tests never share secrets.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# ---------------------------------------------------------------------------- nkeys

_PREFIXES = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
    "server": nkeys.PREFIX_BYTE_SERVER,
    "cluster": nkeys.PREFIX_BYTE_CLUSTER,
}


@dataclass(frozen=True)
class NKey:
    """A freshly generated nkey: ``seed`` (the secret ``S...``) and ``public`` key."""

    seed: str
    public: str

    def sign(self, data: bytes) -> bytes:
        """Raw ed25519 signature of ``data`` with this key."""
        kp = nkeys.from_seed(bytearray(self.seed.encode()))
        return bytes(kp.sign(data))

    def __repr__(self) -> str:
        return f"NKey(public={self.public!r}, seed=***)"


def new_nkey(kind: str = "user") -> NKey:
    """Generate a new nkey of ``kind`` (operator, account, user, server, cluster)."""
    raw = os.urandom(32)
    seed = nkeys.encode_seed(raw, _PREFIXES[kind]).decode()
    public = nkeys.from_seed(bytearray(seed.encode())).public_key.decode()
    return NKey(seed=seed, public=public)


# ---------------------------------------------------------------------------- JWTs


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode_jwt(claims: dict[str, Any], issuer: NKey) -> str:
    """Encode and sign NATS JWT ``claims`` with ``issuer`` (sets ``iss``, ``iat``, ``jti``)."""
    body = dict(claims)
    body["iss"] = issuer.public
    body.setdefault("iat", int(time.time()))
    body.pop("jti", None)
    # nsc computes jti as base32(sha512_256(claims without jti)); any unique value works.
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = {"typ": "JWT", "alg": "ed25519-nkey"}
    signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(body).encode())}"
    return f"{signing_input}.{_b64url(issuer.sign(signing_input.encode()))}"


_UNLIMITED_ACCOUNT = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}

_UNLIMITED_JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


def operator_jwt(operator: NKey, name: str = "TestOperator", system_account: str = "") -> str:
    """Self-signed operator JWT; ``system_account`` names the system account's public key."""
    nats: dict[str, Any] = {"type": "operator", "version": 2}
    if system_account:
        nats["system_account"] = system_account
    return encode_jwt({"sub": operator.public, "name": name, "nats": nats}, operator)


def account_jwt(account: NKey, operator: NKey, name: str, *, jetstream: bool = True) -> str:
    """Account JWT signed by ``operator``, no limits; JetStream enabled if ``jetstream``.

    The system account must not have JetStream (the server refuses to start).
    """
    limits = dict(_UNLIMITED_ACCOUNT)
    if jetstream:
        limits.update(_UNLIMITED_JETSTREAM)
    nats = {"type": "account", "version": 2, "limits": limits}
    return encode_jwt({"sub": account.public, "name": name, "nats": nats}, operator)


def user_jwt(user: NKey, account: NKey, name: str) -> str:
    """User JWT signed by ``account``, allowed to publish/subscribe anything."""
    nats = {
        "type": "user",
        "version": 2,
        "pub": {},
        "sub": {},
        "subs": -1,
        "data": -1,
        "payload": -1,
    }
    return encode_jwt({"sub": user.public, "name": name, "nats": nats}, account)


def creds_text(jwt: str, seed: str) -> str:
    """A ``.creds`` file body in the format written by ``nsc`` and read by every NATS client."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n"
        "\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n"
        "\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n"
        "\n"
        "*************************************************************\n"
    )


@dataclass(frozen=True)
class Decentralized:
    """A complete operator/account/user setup for JWT (decentralized) auth.

    ``server_config`` goes into the server config; ``creds_path`` is the user's .creds file.
    """

    operator: NKey
    system_account: NKey
    account: NKey
    user: NKey
    server_config: str
    creds_path: Path
    user_jwt: str


def make_decentralized(directory: Path) -> Decentralized:
    """Generate operator, system account, app account and user; write ``user.creds`` into dir."""
    operator = new_nkey("operator")
    system = new_nkey("account")
    account = new_nkey("account")
    user = new_nkey("user")
    op_jwt = operator_jwt(operator, system_account=system.public)
    sys_jwt = account_jwt(system, operator, "SYS", jetstream=False)
    acc_jwt = account_jwt(account, operator, "APP")
    u_jwt = user_jwt(user, account, "app-user")
    server_config = (
        f"operator: {op_jwt}\n"
        f"system_account: {system.public}\n"
        "resolver: MEMORY\n"
        "resolver_preload: {\n"
        f"  {system.public}: {sys_jwt}\n"
        f"  {account.public}: {acc_jwt}\n"
        "}\n"
    )
    directory.mkdir(parents=True, exist_ok=True)
    creds_path = directory / "user.creds"
    creds_path.write_text(creds_text(u_jwt, user.seed))
    creds_path.chmod(0o600)
    return Decentralized(operator, system, account, user, server_config, creds_path, u_jwt)


# ---------------------------------------------------------------------------- TLS PKI


@dataclass(frozen=True)
class Pki:
    """PEM files of a throwaway CA, a server cert for 127.0.0.1/localhost, and a client cert."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_tls_block(self, *, verify: bool = True) -> str:
        """A ``tls {}`` server config block using these files (``verify``: require client certs)."""
        return (
            "tls {\n"
            f"  cert_file: {json.dumps(str(self.server_cert))}\n"
            f"  key_file: {json.dumps(str(self.server_key))}\n"
            f"  ca_file: {json.dumps(str(self.ca_cert))}\n"
            f"  verify: {'true' if verify else 'false'}\n"
            "  timeout: 2\n"
            "}\n"
        )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _issue(
    subject_cn: str,
    key: ec.EllipticCurvePrivateKey,
    issuer_name: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    eku: list[x509.ObjectIdentifier] | None = None,
    san: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name if not ca else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if eku:
        builder = builder.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    """Create a CA, a server cert (SAN 127.0.0.1, ::1, localhost) and a client cert in ``dir``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("nats-ordered test CA", ca_key, x509.Name([]), ca_key, ca=True)

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _issue(
        "localhost",
        server_key,
        ca_cert.subject,
        ca_key,
        ca=False,
        eku=[ExtendedKeyUsageOID.SERVER_AUTH],
        san=[
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue(
        "nats-ordered-client",
        client_key,
        ca_cert.subject,
        ca_key,
        ca=False,
        eku=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    paths = Pki(
        ca_cert=directory / "ca.pem",
        ca_key=directory / "ca-key.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
    )
    for cert, cpath in (
        (ca_cert, paths.ca_cert),
        (server_cert, paths.server_cert),
        (client_cert, paths.client_cert),
    ):
        cpath.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(paths.ca_key, ca_key)
    _write_key(paths.server_key, server_key)
    _write_key(paths.client_key, client_key)
    return paths
