"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input or an environment problem the user can fix; the message is shown as is."""


class Terminated(BaseException):
    """SIGTERM during a job: like KeyboardInterrupt, it unwinds through every cleanup."""
