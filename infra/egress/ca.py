"""The egress proxy's certificate authority, made once per machine, and the CA bundle sandboxes trust.

The proxy intercepts TLS (that is how it checks policy per URL, caches and mirrors over https), so
a client must trust its CA. The CA is made here with ``cryptography`` in the file layout mitmproxy
reads from its ``confdir`` (``mitmproxy-ca.pem``: key then certificate; ``mitmproxy-ca-cert.pem``);
mitmproxy makes every leaf certificate itself. It lives in ``egress_home()`` (``~/.cache/agentrl/egress``
or ``$AGENTRL_EGRESS_HOME``), shared by every checkout of the machine, so base images that trust it
(``infra.base_images``, ``infra.services``: the extra-CA mechanism) are built once.

The key never leaves this machine's cache folder; sandboxes get the certificate only.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

CA_NAME = "agentrl egress proxy CA"
HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt",)


def egress_home() -> Path:
    """The machine's egress folder: ``$AGENTRL_EGRESS_HOME`` or ``~/.cache/agentrl/egress``."""
    return Path(os.environ.get("AGENTRL_EGRESS_HOME") or Path.home() / ".cache" / "agentrl" / "egress")


def host_bundle() -> Path | None:
    """The machine's CA bundle (``$PIP_CERT``, ``$SSL_CERT_FILE``, else the system bundle), if one exists."""
    found = [os.environ.get(k, "") for k in ("PIP_CERT", "SSL_CERT_FILE")] + list(HOST_BUNDLES)
    return next((Path(f) for f in found if f and Path(f).is_file()), None)


def ensure_ca(home: Path | None = None) -> Path:
    """Make the proxy's CA under ``home/ca`` unless it exists; returns the certificate's path.

    Raises:
        OSError: the folder cannot be written.
    """
    confdir = (home or egress_home()) / "ca"
    cert_path = confdir / "mitmproxy-ca-cert.pem"
    if cert_path.is_file() and (confdir / "mitmproxy-ca.pem").is_file():
        return cert_path
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentrl")])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=2)).not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    confdir.mkdir(parents=True, exist_ok=True)
    both = confdir / "mitmproxy-ca.pem.tmp"
    both.write_bytes(key_pem + cert_pem)
    both.chmod(0o600)
    cert_tmp = confdir / "mitmproxy-ca-cert.pem.tmp"
    cert_tmp.write_bytes(cert_pem)
    both.replace(confdir / "mitmproxy-ca.pem")
    cert_tmp.replace(cert_path)
    return cert_path


def ensure_bundle(home: Path | None = None) -> Path:
    """The CA bundle a sandbox behind the proxy trusts: the machine's bundle plus the proxy's CA.

    Written to ``home/ca-bundle.pem`` when its content changes (so its digest, a label on the base
    images, changes only then).
    """
    home = home or egress_home()
    ca = ensure_ca(home).read_text()
    base = host_bundle()
    text = (base.read_text() if base else "").rstrip("\n") + "\n" + ca
    out = home / "ca-bundle.pem"
    if not out.is_file() or out.read_text() != text:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    return out
