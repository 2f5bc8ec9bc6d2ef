"""How a hearth-replay command ends: its exit code, and a failure said in one line (1: a member key it cannot use, 2:
bad input, 3: the broker unreachable or refusing), never a traceback."""

from __future__ import annotations

import typer

from hearth.services.cli_errors import stdout_to_devnull
from hearth.services.cli_options import EXIT_REFUSED


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"hearth-replay: {message}", err=True)
    return typer.Exit(code)


def run_command(coroutine) -> int:
    """Run one command's coroutine; SIGINT/SIGTERM stop it cleanly (consumers are deleted on the way out)."""
    import nats.errors
    from hearth.services.broker.connection import BrokerUnreachable
    from hearth.services.common.identity import IdentityError
    from hearth.services.common.lifecycle import Interrupted, run_cancelling_on_signal
    from hearth.services.replay.broker import MemberRefused
    from hearth.services.replay.render import broker_failure_line

    try:
        return run_cancelling_on_signal(coroutine)
    except Interrupted:
        return 130
    except BrokenPipeError:
        # Whoever read stdout went away (`| head`): it took what it wanted, which is no fault of the broker's.
        stdout_to_devnull()
        return 0
    except IdentityError as error:  # the key --creds names, unreadable or not a member's: as a roster check says it
        raise fail(str(error), EXIT_REFUSED) from None
    except (BrokerUnreachable, MemberRefused) as error:
        raise fail(str(error), 3) from None
    except (nats.errors.NoServersError, ConnectionRefusedError, OSError) as error:
        if isinstance(error, OSError) and error.filename is not None:  # a file it was given, not the broker
            raise fail(f"{error.filename}: {error.strerror or error}") from None
        raise fail(f"cannot reach NATS: {error}", 3) from error
    except nats.errors.Error as error:  # reached, but it did not answer as a JetStream broker does
        raise fail(broker_failure_line(error), 3) from None

