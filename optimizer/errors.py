"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input or an environment problem the user can fix; the message is shown as is."""
