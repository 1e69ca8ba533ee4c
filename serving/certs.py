"""The cluster's certificate authority and the certificates it issues (the ``cryptography`` package).

``pdcluster up`` creates one CA per cluster (:func:`create_ca`, EC P-256, 10 years) and keeps
its key in the state directory (mode 0600). Every process then issues itself a leaf
certificate for the addresses it serves on (:func:`issue`, 1 year, ``serverAuth`` and
``clientAuth``, SANs for each IP address or DNS name), so router<->worker and prefill->decode
traffic can be mutually authenticated with certificates that all chain to the cluster CA.

Everything is PEM bytes; nothing here opens sockets.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM-encoded (``key_pem``: PKCS#8, unencrypted)."""

    cert_pem: bytes
    key_pem: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdcluster"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def create_ca(cluster: str, days: int = 3650) -> KeyPair:
    """A self-signed CA for ``cluster`` (may sign leaf certificates only: path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(f"pdcluster CA {cluster}")).issuer_name(
        _name(f"pdcluster CA {cluster}")).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def issue(ca: KeyPair, common_name: str, hosts: list[str], days: int = 365) -> KeyPair:
    """A leaf certificate signed by ``ca`` for ``hosts`` (IP addresses and/or DNS names), usable
    as a TLS server and client certificate.

    Raises:
        ValueError: ``hosts`` is empty, or ``ca`` is not a readable CA key pair.
    """
    if not hosts:
        raise ValueError("a certificate needs at least one host (IP address or DNS name)")
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))
