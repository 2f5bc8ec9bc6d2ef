"""TLS for NATS connections: the client's ssl context from the [nats] tls_* files, and a throwaway certificate
authority (CA, a server certificate for the broker's host names, a client certificate) for the demo and tests."""

from __future__ import annotations

import datetime
import ipaddress
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from hearth.trust.keys import make_private_folder, write_private_file

if TYPE_CHECKING:
    from cryptography import x509

throwaway_validity_days = 7
# A certificate that ends within this many days is said to end soon (`hearth doctor`, `hearth nats`): time for the
# steward to make new ones.
certificate_warning_days = 30
max_dns_name_chars = 253
_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class TlsConfigError(ValueError):
    """The configured TLS files are incomplete or unreadable, or a host name no certificate can hold."""


def client_ssl_context(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> ssl.SSLContext | None:
    """None without a CA (plain TCP); else a context that trusts `ca_file` and, given both, presents the client
    certificate (for a broker that verifies clients)."""
    if ca_file is None:
        if cert_file or key_file:
            raise TlsConfigError("tls_cert_file/tls_key_file need tls_ca_file (the CA that signed the broker's cert)")
        return None
    if (cert_file is None) != (key_file is None):
        raise TlsConfigError("give both tls_cert_file and tls_key_file, or neither")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
        if cert_file is not None:
            context.load_cert_chain(str(cert_file), str(key_file))
    except (OSError, ssl.SSLError) as error:
        raise TlsConfigError(f"cannot use the TLS files: {error}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


# What CertificateDates.judged says of a set of certificates.
CertificateState = Literal["ended", "not_begun", "ends_soon", "valid"]


@dataclass(frozen=True)
class CertificateDates:
    """When the certificates of some PEM files are valid: the first to end (its file and end), and the first found
    that has not begun yet (None when all have)."""

    first_to_end: Path
    ends: datetime.datetime
    not_begun: tuple[Path, datetime.datetime] | None

    def judged(self, now: datetime.datetime) -> tuple[CertificateState, str]:
        """Whether the certificates can be used at `now`, judged by the one that says most (ended, not begun, ending
        within `certificate_warning_days`), and a clause saying so."""
        if self.ends <= now:
            return "ended", f"the certificate in {self.first_to_end} ended on {self.ends:%Y-%m-%d %H:%M} UTC"
        if self.not_begun is not None:
            path, begins = self.not_begun
            return "not_begun", (f"the certificate in {path} begins on {begins:%Y-%m-%d %H:%M} UTC, after this "
                                 f"machine's clock ({now:%Y-%m-%d %H:%M} UTC)")
        days_left = (self.ends - now).days
        if days_left < certificate_warning_days:
            return "ends_soon", (f"the certificate in {self.first_to_end} ends on {self.ends:%Y-%m-%d} ({days_left} "
                                 "days from now)")
        return "valid", f"the first certificate to end does on {self.ends:%Y-%m-%d}"


def certificate_dates(files: list[Path], now: datetime.datetime) -> CertificateDates | None:
    """The validity of every certificate in `files` (PEM) at `now`; None when they hold none that cryptography
    reads (ssl may still load them: a format it reads and cryptography does not)."""
    from cryptography import x509

    certificates = []
    for path in files:
        try:
            certificates += [(path, certificate) for certificate in x509.load_pem_x509_certificates(path.read_bytes())]
        except (OSError, ValueError):
            continue
    if not certificates:
        return None
    first_path, first = min(certificates, key=lambda found: found[1].not_valid_after_utc)
    not_begun = next(((path, certificate.not_valid_before_utc) for path, certificate in certificates
                      if certificate.not_valid_before_utc > now), None)
    return CertificateDates(first_path, first.not_valid_after_utc, not_begun)


@dataclass(frozen=True)
class TlsFiles:
    """Where a throwaway CA wrote its files."""

    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path

    def server_block(self) -> str:
        return server_tls_block(self.server_cert_file, self.server_key_file, self.ca_file)


def server_tls_block(cert_file: Path, key_file: Path, client_ca_file: Path | None = None) -> str:
    """nats-server's `tls { ... }` block: TLS only, with client certificates verified against `client_ca_file`."""
    lines = [f'  cert_file: "{cert_file.resolve()}"', f'  key_file: "{key_file.resolve()}"']
    if client_ca_file is not None:
        lines += [f'  ca_file: "{client_ca_file.resolve()}"', "  verify: true"]
    return "tls {\n" + "\n".join([*lines, "  timeout: 2"]) + "\n}\n"


def certificate_host_name(host: str) -> "x509.GeneralName":
    """What a certificate names `host` by: an IP address, or a DNS name in ASCII (labels of letters, digits and
    hyphens, a `*.` wildcard first at most); TlsConfigError for anything else, which no client could match."""
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.removeprefix("*.").split(".")
    if len(host) > max_dns_name_chars or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise TlsConfigError(f"{host[:80]!r} is neither an IP address nor a DNS name (ASCII letters, digits, hyphens "
                             "and dots; an internationalized name in its xn-- form)")
    return x509.DNSName(host)


def write_throwaway_ca(directory: Path, host_names: tuple[str, ...] = ("localhost", "127.0.0.1"), *,
                       validity_days: int = throwaway_validity_days) -> TlsFiles:
    """A new CA with one server certificate (for `host_names`) and one client certificate, each file mode 0600 in a
    folder of mode 0700; TlsConfigError, with nothing written, for a host name no certificate can hold."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    alt_names = [certificate_host_name(host) for host in host_names]
    make_private_folder(directory)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid_until = now + datetime.timedelta(days=validity_days)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def write_key(path: Path, key) -> None:
        # Created mode 0600 and renamed into place (never readable by others, not even for a moment; a key made
        # again replaces the old one whole), never through a link planted there.
        write_private_file(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("hearth throwaway CA")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(valid_until)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))

    def issue(common_name: str, usage, alt_names: list) -> tuple[bytes, object]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(common_name)).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now).not_valid_after(valid_until)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), key

    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem",
                     directory / "client.pem", directory / "client-key.pem")
    # The certificates are public, but one others could replace (a CA swapped in) is not: written as the keys are,
    # whatever the umask, never through a planted link; the CA's own key is never written (nothing more is issued).
    write_private_file(files.ca_file, ca_cert.public_bytes(serialization.Encoding.PEM))
    server_pem, server_key = issue("hearth broker", ExtendedKeyUsageOID.SERVER_AUTH, alt_names)
    write_private_file(files.server_cert_file, server_pem)
    write_key(files.server_key_file, server_key)
    client_pem, client_key = issue("hearth member", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    write_private_file(files.client_cert_file, client_pem)
    write_key(files.client_key_file, client_key)
    return files
