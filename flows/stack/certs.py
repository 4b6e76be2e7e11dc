"""The secured stack's certificates: a CA of its own and a server certificate for the address it
listens on (private keys 0600), or a team's own (`--tls-cert/--tls-key`)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
from dataclasses import dataclass
from pathlib import Path

from flows.stack.users import folder, private
from mllm import UserError


@dataclass
class Certs:
    ca: Path  # what clients verify against
    cert: Path
    key: Path


def certificates(home: Path, hosts: list[str], cert: str | None = None, key: str | None = None) -> Certs:
    """The team's own certificate (`cert`, `key`; `ca`: the cert file itself, which holds its
    chain), or the stack's: a CA made once and a server certificate for `hosts`, made again
    when the hosts change or it is within 30 days of its end."""
    tls = folder(home) / "tls"
    if cert or key:
        if not (cert and key):
            raise UserError("give both --tls-cert FILE and --tls-key FILE (or neither: the stack makes its own)")
        for p in (cert, key):
            if not Path(p).is_file():
                raise UserError(f"{p}: no such file (--tls-cert/--tls-key take PEM files)")
        return Certs(Path(cert).resolve(), Path(cert).resolve(), Path(key).resolve())
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM
    ca_file, ca_key_file = tls / "ca.pem", tls / "ca-key.pem"
    if not ca_file.exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"mllm stack CA ({socket.gethostname()})")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        private(ca_key_file, ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        ca_file.write_bytes(ca_cert.public_bytes(pem))
    server_file, server_key_file, hosts_file = tls / "server.pem", tls / "server-key.pem", tls / "hosts.json"
    wanted = sorted(set(hosts))
    if (
        server_file.exists()
        and hosts_file.exists()
        and json.loads(hosts_file.read_text()) == wanted
        and _valid_for(server_file, now, datetime.timedelta(days=30))
    ):
        return Certs(ca_file, server_file, server_key_file)
    cert_pem, key_pem = sign_server(
        tls, wanted, now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=397)
    )
    private(server_key_file, key_pem)
    server_file.write_bytes(cert_pem)
    hosts_file.write_text(json.dumps(wanted) + "\n")
    return Certs(ca_file, server_file, server_key_file)


def _valid_for(cert_file: Path, now: datetime.datetime, margin: datetime.timedelta) -> bool:
    """Whether the certificate in `cert_file` stays valid `margin` past `now`: an expired one (or
    one about to expire) is made again at the next `stack up`, never served."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_file.read_bytes()).not_valid_after_utc > now + margin


def sign_server(
    tls: Path, hosts: list[str], valid_from: datetime.datetime, valid_to: datetime.datetime
) -> tuple[bytes, bytes]:
    """A server certificate for `hosts` from the CA in `tls` (PEM: the certificate followed by
    the CA's, and its private key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pem = serialization.Encoding.PEM
    ca_cert = x509.load_pem_x509_certificate((tls / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((tls / "ca-key.pem").read_bytes(), None)
    key_ = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key_.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return (
        server.public_bytes(pem) + ca_cert.public_bytes(pem),
        key_.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def hosts_for(listen: str) -> list[str]:
    """What the server certificate names: the listening address, loopback, this host's names."""
    return sorted({listen, "127.0.0.1", "localhost", socket.gethostname(), socket.getfqdn()} - {""})
