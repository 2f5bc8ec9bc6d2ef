"""The checks of `hearth doctor` that need no broker and no model: the member key and the roster copy (the role and
name they give), the TLS files, the free space where hearth keeps its state, the gateway's API keys. Each reads only,
through the functions the commands themselves load these files with."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hearth.formats.cache_layout import hearth_cache_dir
from hearth.services.broker.permissions import admitted
from hearth.services.broker.store_space import MiB, free_bytes
from hearth.services.broker.tls import TlsConfigError, certificate_dates, client_ssl_context
from hearth.services.cli_options import NO_CREDENTIALS_FIX, member_refusal
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.common.identity import Identity, IdentityError, default_roster_for, load_identity
from hearth.services.doctor.report import CheckResult, fail, ok, skip, warn
from hearth.services.doctor.roles import ROSTER_ROLE, DoctorRole
from hearth.trust.keys import KeyFileError, MemberKey
from hearth.trust.roster import CALLER_ROLES, KEYS_DIR, ROSTER_FILE, SEED_SUFFIX, Roster, RosterError

# Free space below which a disk where hearth keeps state is said to be nearly full, and full: an event outbox, a
# read model or a fetched layer written there next would fail.
low_disk_warn_bytes = 1024 * MiB
low_disk_fail_bytes = 64 * MiB
# The roles that may run without a roster (they go by their key file's name): only callers, which check no one.
ROLES_WITHOUT_ROSTER: tuple[DoctorRole, ...] = ("client",)
ROSTER_FIX = "put the community's current roster.json beside the key's keys/ folder, or set [nats] roster_file"
CERTIFICATES_FIX = ("ask the steward for new TLS files (`hearth community tls --replace --host ...` makes them; the "
                    "broker is restarted on its new certificate) and copy them where [nats] tls_ca_file, "
                    "tls_cert_file and tls_key_file point")


@dataclass(frozen=True)
class MemberSetup:
    """What the key and roster checks leave for the broker's: whether a login may be tried (a key that loads, or an
    open broker), as whom, and whether the member may run the role (else the broker refuses what the role's checks
    ask, and only the login is tried)."""

    may_connect: bool
    name: str | None = None
    fits_role: bool = True


def key_file_for(nats: NatsSettings, community: Path | None, name: str | None) -> Path | None:
    """The member key a command would log in with: --creds or [nats] creds_file, else NAME's key in the community
    folder (DIR/keys/NAME.nk, where `hearth community add` and `keygen` write it)."""
    if nats.creds_file is not None:
        return nats.creds_file
    if community is not None and name is not None:
        return community / KEYS_DIR / f"{name}{SEED_SUFFIX}"
    return None


def member_checks(nats: NatsSettings, role: DoctorRole, name: str | None) -> tuple[list[CheckResult], MemberSetup]:
    """The key (`nats.creds_file`: readable by its owner only, a member seed), the roster the commands find for it,
    and the member it names: in the roster, of `role`'s roster role, named `name` when given, trusted enough for the
    broker to give it a login."""
    creds = nats.creds_file
    if creds is None:
        if nats.insecure:
            open_broker = warn("credentials", "none (--insecure): anyone who reaches an open broker can read "
                                              "prompts and activations and forge routing",
                               "on a community's broker give --creds FILE")
            return [open_broker], MemberSetup(may_connect=True)
        return [fail("credentials", "no member key", NO_CREDENTIALS_FIX)], MemberSetup(may_connect=False)
    try:
        MemberKey.load(creds)
    except KeyFileError as error:
        told = "chmod" in str(error)  # the refusal of a key others may read says what to run
        fix = None if told else (f"copy this member's key from the steward (`hearth community add` wrote "
                                 f"keys/{name or 'NAME'}.nk), or make one here: hearth community keygen --name "
                                 f"{name or 'NAME'}")
        return [fail("key", str(error), fix)], MemberSetup(may_connect=False)
    checks = [ok("key", f"{creds} holds a member key, readable by its owner only")]
    roster_file = nats.roster_file or default_roster_for(creds)
    if roster_file is None:
        where = creds.parent.parent / ROSTER_FILE if creds.parent.name == KEYS_DIR else f"beside {creds}"
        verdict = warn if role in ROLES_WITHOUT_ROSTER else fail
        checks.append(verdict("roster", f"none found ({where} is missing, and [nats] roster_file is not set): a "
                                        f"{role} checks its own role and the members' signatures against it",
                              ROSTER_FIX))
        return checks, MemberSetup(may_connect=True, name=creds.stem)
    try:
        roster = Roster.load(roster_file)
    except RosterError as error:
        return [*checks, fail("roster", str(error), ROSTER_FIX)], MemberSetup(may_connect=False)
    checks.append(ok("roster", f"{roster_file}: community {roster.community!r}, {len(roster.members)} members"))
    try:
        identity = load_identity(creds, roster_file)
    except IdentityError as error:
        return [*checks, fail("member", str(error), "if the steward has added this key since, copy its current "
                                                    "roster.json here")], MemberSetup(may_connect=False)
    verdict = _member_verdict(identity, roster, role, name, creds)
    checks.append(verdict)
    return checks, MemberSetup(may_connect=True, name=identity.name, fits_role=verdict.verdict != "fail")


def _member_verdict(identity: Identity, roster: Roster, role: DoctorRole, name: str | None,
                    creds: Path) -> CheckResult:
    """Whether the roster's member for the key may run as `role` under `name`."""
    roster_role = ROSTER_ROLE[role]
    if name is not None and name != identity.name:
        known = roster.by_name(name) is not None
        detail = f"the key in {creds} belongs to {identity.name}, not {name}" + (
            "" if known else f", and the roster has no member {name}")
        fix = (f"log in with {name}'s own key (keys/{name}{SEED_SUFFIX})" if known else
               f"the steward adds {name}: hearth community add --name {name} --role {roster_role}")
        return fail("member", detail, fix)
    if role == "client" and identity.member is not None and identity.member.role in CALLER_ROLES:
        roster_role = identity.member.role  # orchestrators take the steward's calls too
    why = member_refusal(identity, roster_role, None)
    if why is not None:
        return fail("member", why)
    member = identity.member
    assert member is not None  # member_refusal refuses a key no roster names
    if not admitted(member):
        return fail("member", f"{identity.name} is trusted as {member.trust}: the broker gives shard hosts and "
                              "orchestrators below trusted no login (they see activations)",
                    "ask a steward for a key of a member trusted as trusted or steward")
    return ok("member", f"{identity.name}, {member.role} ({member.trust}) in the roster")


def tls_check(nats: NatsSettings) -> CheckResult:
    """The [nats] tls_* files load as the commands load them: the CA, and the client certificate with its key."""
    if nats.tls_ca_file is None and nats.tls_cert_file is None and nats.tls_key_file is None:
        return ok("tls", "not configured: plain TCP to the broker")
    try:
        client_ssl_context(nats.tls_ca_file, nats.tls_cert_file, nats.tls_key_file)
    except TlsConfigError as error:
        return fail("tls", str(error), "copy the community's tls/ca.pem, tls/client.pem and tls/client-key.pem from "
                                       "the steward and set [nats] tls_ca_file, tls_cert_file and tls_key_file to "
                                       "them")
    client = f"; client certificate {nats.tls_cert_file} matches its key" if nats.tls_cert_file else ""
    return certificate_dates_check([path for path in (nats.tls_ca_file, nats.tls_cert_file) if path is not None],
                                   f"CA {nats.tls_ca_file} loads{client}")


def certificate_dates_check(files: list[Path], loaded: str, now: datetime.datetime | None = None) -> CheckResult:
    """The TLS check's verdict once `files` loaded (`loaded` says so): fail when a certificate in them has ended or
    has not begun (this machine's clock, or the files, are wrong: every TLS handshake fails), warn when one ends
    within `certificate_warning_days` (broker/tls.py)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    dates = certificate_dates(files, now)
    if dates is None:
        return ok("tls", loaded)
    state, said = dates.judged(now)
    if state == "ended":
        return fail("tls", f"{said}: every TLS handshake with it fails", CERTIFICATES_FIX)
    if state == "not_begun":
        return fail("tls", f"{said}: every TLS handshake with it fails",
                    "set this machine's clock right (NTP), or ask the steward for the current tls/ files")
    return (warn("tls", f"{loaded}; {said}", CERTIFICATES_FIX) if state == "ends_soon"
            else ok("tls", f"{loaded}; {said}"))


def disk_checks(folders: Iterable[Path], free_of: Callable[[Path], int] = free_bytes) -> list[CheckResult]:
    """The free space (`free_of`) of each disk holding one of `folders` (where hearth keeps state: one not made yet
    is judged by the nearest folder above it that exists), one line per disk."""
    by_disk: dict[int, tuple[Path, list[Path]]] = {}
    for folder in folders:
        existing = _nearest_existing(folder.expanduser())
        try:
            disk = existing.stat().st_dev
        except OSError:
            continue
        by_disk.setdefault(disk, (existing, []))[1].append(folder)
    checks = []
    for existing, named in by_disk.values():
        where = ", ".join(str(folder) for folder in named)
        try:
            free = free_of(existing)
        except OSError as error:
            checks.append(warn("disk", f"the free space of {where} cannot be read: {error.strerror or error}"))
            continue
        said = f"{free / (1024 * MiB):.1f} GiB free on the disk of {where}"
        fix = "free space on that disk"
        if any(_within(folder.expanduser(), hearth_cache_dir()) for folder in named):
            fix += " (`hearth cache list` shows what hearth's cache holds there, `hearth cache clear` removes it)"
        if free < low_disk_fail_bytes:
            checks.append(fail("disk", f"only {said}", fix))
        elif free < low_disk_warn_bytes:
            checks.append(warn("disk", f"only {said}", fix))
        else:
            checks.append(ok("disk", said))
    return checks


def _within(folder: Path, parent: Path) -> bool:
    return folder == parent or parent in folder.parents


def _nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def api_keys_check(community: Path | None, settings: HearthSettings, on_community_mesh: bool) -> CheckResult:
    """The gateway's API keys: the folder it would read them from, and each key's member and signing key there."""
    from hearth.services.gateway.command import api_keys_folder
    from hearth.services.gateway.keys import ApiKeyError, ApiKeyring

    try:
        folder = api_keys_folder(community, settings, on_community_mesh=on_community_mesh)
    except ValueError as error:
        return fail("api keys", str(error))
    if folder is None:
        return skip("api keys", "an open mesh: the gateway asks callers for no API key")
    try:
        keyring = ApiKeyring.load(folder)
    except ApiKeyError as error:
        return fail("api keys", str(error))
    members = keyring.members
    return ok("api keys", f"{len(keyring)} keys of {len(members)} members in {folder}: {', '.join(members) or '-'}")


def state_folders(settings: HearthSettings, role: DoctorRole) -> list[Path]:
    """Where `role`'s process keeps what it writes: hearth's state folder, and its event outbox where configured
    elsewhere."""
    from hearth.services.common.hearth_files import state_dir

    folders = [state_dir("")]
    outbox = {"orchestrator": settings.orchestrator.event_outbox_dir, "shard": settings.shard.event_outbox_dir,
              "host": settings.shard.event_outbox_dir}.get(role)
    return [*folders, *([outbox] if outbox is not None else [])]
