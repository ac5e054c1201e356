"""optimizer's name for core.errors (the exceptions moved there so exporters and serve need not import optimizer)."""

from core.errors import Terminated, UserError  # noqa: F401
