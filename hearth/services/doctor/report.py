"""What `hearth doctor` found: one verdict per check (ok, warn, fail, skip) with what it checked and what fixes a
failure, shown as one line each or as one JSON document (`--json`), and the exit code it leads to."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Verdict = Literal["ok", "warn", "fail", "skip"]
# How a line shows each verdict: a failure stands out in a column of oks.
VERDICT_WORDS: dict[Verdict, str] = {"ok": "ok", "warn": "warn", "fail": "FAIL", "skip": "skip"}
EXIT_ALL_PASSED = 0
EXIT_A_CHECK_FAILED = 1


class CheckResult(BaseModel):
    """One check's verdict: `check` names what was checked, `detail` what was found, `fix` what to do about a
    failure or a warning (a command where there is one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    check: str = Field(min_length=1, max_length=64)
    verdict: Verdict
    detail: str
    fix: str | None = None

    def line(self) -> str:
        """The check as one line: verdict, what, and the fix after it."""
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{VERDICT_WORDS[self.verdict]:<4}  {self.check}: {self.detail}{fix}"


class DoctorReport(BaseModel):
    """Every check `hearth doctor` ran, in order; `passed` is false when one failed (warnings and skips pass)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str
    passed: bool
    checks: list[CheckResult]

    @classmethod
    def of(cls, role: str, checks: list[CheckResult]) -> "DoctorReport":
        return cls(role=role, passed=not any(check.verdict == "fail" for check in checks), checks=checks)

    @property
    def exit_code(self) -> int:
        return EXIT_ALL_PASSED if self.passed else EXIT_A_CHECK_FAILED


def ok(check: str, detail: str) -> CheckResult:
    return CheckResult(check=check, verdict="ok", detail=detail)


def warn(check: str, detail: str, fix: str | None = None) -> CheckResult:
    return CheckResult(check=check, verdict="warn", detail=detail, fix=fix)


def fail(check: str, detail: str, fix: str | None = None) -> CheckResult:
    return CheckResult(check=check, verdict="fail", detail=detail, fix=fix)


def skip(check: str, detail: str) -> CheckResult:
    return CheckResult(check=check, verdict="skip", detail=detail)
