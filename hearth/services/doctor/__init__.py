"""`hearth doctor`: a household checks its setup in one command, reading only (command.py; each check's verdict is
report.py's CheckResult)."""
