"""The `hearth doctor` command line, and the order its checks run in: the configuration, the member key and roster,
TLS, the gateway's API keys, the model, the disks, then the broker's checks and the memory budget (typer only here;
each check's module is imported when it runs)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from hearth.services.cli_options import CredsOption, InsecureOption, NatsUrlOption, cli_state
from hearth.services.doctor.roles import BUDGET_ROLES, DOCTOR_ROLES, MODEL_ROLES, DoctorRole
from hearth.services.host.cli import MemoryBudgetOption
from hearth.services.model_options import DeviceOption, DtypeOption, QuantizeOption
from hearth.trust.roster import MEMBER_NAME_PATTERN

if TYPE_CHECKING:
    from hearth.services.common.config import HearthSettings
    from hearth.services.doctor.report import CheckResult


def checked_role(value: str) -> str:
    """--role as one of DOCTOR_ROLES, else a usage error (exit code 2)."""
    if value not in DOCTOR_ROLES:
        raise typer.BadParameter(f"one of {', '.join(DOCTOR_ROLES)}, not {value[:40]!r}")
    return value


def checked_member_name(value: str | None) -> str | None:
    """--name as a member name can be (a NATS subject token), else a usage error."""
    if value is not None and not re.fullmatch(MEMBER_NAME_PATTERN, value):
        raise typer.BadParameter(f"{value[:40]!r} is no member name: letters, digits, '_' and '-', at most 63")
    return value


def doctor_command(
    ctx: typer.Context,
    role: Annotated[str, typer.Option(
        "--role", callback=checked_role, metavar="|".join(DOCTOR_ROLES),
        help="What this machine is to run: `hearth shard`, `hearth host`, `hearth orchestrator`, `hearth projector`, "
             "`hearth chat` (client) or `hearth gateway`.")],
    name: Annotated[Optional[str], typer.Option(
        "--name", callback=checked_member_name, show_default=False,
        help="This member's name as the roster has it: the key must be its key (with --community and no --creds, "
             "the key is DIR/keys/NAME.nk).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", show_default=False,
        help="The model the command will serve (shard, host; an orchestrator's --preload or --local-model): a "
             "checkpoint folder, GGUF file, ollama:NAME[:TAG], hub model id or store:NAME.")] = None,
    memory_budget_mb: MemoryBudgetOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
    community: Annotated[Optional[Path], typer.Option(
        "--community", show_default=False,
        help="The community folder this machine holds (roster.json, keys/; a gateway's api_keys.json): default, the "
             "folder of the key; a gateway's [gateway] community_dir.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON document.")] = False,
) -> None:
    """Check this machine's setup for a role in one go, reading only: the configuration, the member key (its file's
    mode) and roster copy (the member's name and role), the TLS files, the free disk where hearth keeps state, the
    model and whether the memory budget holds a layer of it, the broker (reached, the key admitted, the event
    streams there, this clock against the broker's; skipped when it cannot be reached), a gateway's API keys.

    One line per check: ok, warn, FAIL (with what fixes it) or skip. Nothing is written and no key is printed; every
    wait on the network is a few seconds at most. Exit code 0 when no check failed, 1 when one did, 2 for bad
    options."""
    if model is not None and role not in MODEL_ROLES:
        raise typer.BadParameter(f"is for {', '.join(MODEL_ROLES)}, not {role}", param_hint="--model")
    if memory_budget_mb is not None and role not in BUDGET_ROLES:
        raise typer.BadParameter(f"is for {', '.join(BUDGET_ROLES)}, not {role}", param_hint="--memory-budget-mb")
    from hearth.services.doctor.report import DoctorReport

    checks = run_checks(cli_state(ctx).config_path, role, name=name, model=model, memory_budget_mb=memory_budget_mb,
                        device=device, dtype=dtype, quantize=quantize, nats_url=nats_url, creds=creds,
                        insecure=insecure, community=community)
    report = DoctorReport.of(role, checks)
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        for check in report.checks:
            typer.echo(check.line())
    raise typer.Exit(report.exit_code)


def run_checks(config_path: Path | None, role: DoctorRole, *, name: str | None, model: str | None,
               memory_budget_mb: float | None, device: str | None, dtype: str | None, quantize: str | None,
               nats_url: str | None, creds: Path | None, insecure: bool, community: Path | None) -> list[CheckResult]:
    """Every check `role` has, in the order they are shown; the broker's are skipped when the member's key cannot be
    used or the TLS files do not load."""
    from hearth.services.common.config import ConfigError, load_settings
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.services.doctor import broker_checks as broker
    from hearth.services.doctor.model_checks import memory_check, model_source_check
    from hearth.services.doctor.report import fail, skip
    from hearth.services.doctor.setup_checks import (
        api_keys_check, disk_checks, key_file_for, member_checks, state_folders, tls_check)

    try:
        settings = load_settings(config_path)
    except ConfigError as error:
        return [fail("configuration", str(error), "every key is in `hearth docs configuration`")]
    checks = [configuration_check(config_path, settings, role)]
    nats = settings.nats.model_copy(update={"url": nats_url or settings.nats.url,
                                            "insecure": insecure or settings.nats.insecure})
    nats = nats.model_copy(update={"creds_file": creds or key_file_for(nats, community, name)})
    settings = settings.model_copy(update={"nats": nats})
    found, member = member_checks(nats, role, name)
    tls = tls_check(nats)
    checks += [*found, tls]
    if role == "gateway":
        checks.append(api_keys_check(community, settings, on_community_mesh=nats.creds_file is not None))
    source = None
    if model is not None:
        line, source = model_source_check(model)
        checks += [line] if line is not None else []
    elif role in MODEL_ROLES:
        checks.append(skip("model", "no --model given"))
    checks += disk_checks([*state_folders(settings, role), *(model_cache_folders() if model else [])])
    store_name = source.store_name if source is not None else None
    if not member.may_connect or tls.verdict == "fail":
        checks += [skip("broker", "the key or the TLS files above cannot be used to log in"),
                   *broker.skipped_broker_checks(role, "no login", store_name)]
        manifest = None
    else:
        findings = run_event_loop(broker.broker_checks(settings, role, member.name, store_name,
                                                       fits_role=member.fits_role))
        checks += findings.checks
        manifest = findings.manifest
    if source is not None and role in BUDGET_ROLES:
        memory = memory_check(source, manifest, settings, memory_budget_mb=memory_budget_mb, device=device,
                              dtype=dtype, quantize=quantize)
        checks += [memory] if memory is not None else []
    return checks


def configuration_check(config_path: Path | None, settings: HearthSettings, role: DoctorRole) -> CheckResult:
    """The configuration read (a file, or the defaults), and a shard host's refused by it."""
    from hearth.services.common.config_processes import serve_shards_refused
    from hearth.services.doctor.report import fail, ok

    if role in BUDGET_ROLES and serve_shards_refused(settings.shard):
        return fail("configuration", "[shard] serve_shards = false: this machine refuses to serve shards",
                    "set [shard] serve_shards = true, or leave it out")
    read = f"{config_path} read" if config_path is not None else "no file (--config, $HEARTH_CONFIG): the defaults"
    return ok("configuration", f"{read}, HEARTH_* variables over it")


def model_cache_folders() -> list[Path]:
    """Where a model's files are written when it is fetched (the hub cache, hearth's cache of parsed GGUFs and of
    layers fetched on their own)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    from hearth.inference.checksum import weights_cache_file

    return [weights_cache_file().parent, Path(HF_HUB_CACHE)]
