"""The exception the CLIs turn into a one-line message and a non-zero exit, the one that unwinds
a job on SIGTERM, and the decorator that does the turning for every click command."""

import functools
import sys


class UserError(Exception):
    """Bad input or an environment problem the user can fix; the message is shown as is."""


class Terminated(BaseException):
    """SIGTERM during a job: like KeyboardInterrupt, it unwinds through every cleanup."""


def one_line_errors(fn):
    """A click command's UserError → one line on stderr and exit 2; Ctrl-C → 130; SIGTERM → 143."""
    import click

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted; no output was written", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("terminated (SIGTERM); no output was written", err=True)
            sys.exit(143)
    return wrapper
