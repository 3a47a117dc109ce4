"""Throwaway TLS material for tests (the ``cryptography`` package): a CA and certificates it issues,
written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """PEM files: ``cert`` (the certificate) and ``key`` (its private key)."""

    cert: Path
    key: Path


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return Issued(cert_path, key_path)


def _builder(subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


class CA:
    """A self-signed CA under ``directory`` (``name``.crt/.key) that issues server certificates."""

    def __init__(self, directory: Path, name: str = "test-ca") -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False,
        )  # fmt: skip
        cert = (
            _builder(name, self._name, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.files = _write(directory / name, cert, self._key)

    @property
    def cert(self) -> Path:
        return self.files.cert

    def issue(self, name: str, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> Issued:
        """A server certificate for ``dns`` names and ``ips`` (its subject alternative names)."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = (
            _builder(name, self._name, key.public_key())
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return _write(self.directory / name, cert, key)
