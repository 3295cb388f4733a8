"""Rendering values into bash.

Every value is ``shlex``-quoted. The only unquoted fragments a script may contain are the fixed ones defined
here: :class:`ShellExpansion` members and ``"$HOME"``. Neither can be built from user text.
"""

from __future__ import annotations

import enum
import re
import shlex

from airflow_tpu_posttrain.recipes.validation import SpecError

_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class ShellExpansion(enum.Enum):
    """A value the remote shell computes when the script runs (a closed set)."""

    HOSTNAME = "$(hostname)"

    def render(self) -> str:
        return f'"{self.value}"'


EnvValue = str | ShellExpansion


def export_line(name: str, value: EnvValue) -> str:
    if not _ENV_NAME.fullmatch(name):
        raise SpecError("env", name, "is not an environment variable name", "use A-Z, 0-9 and '_'")
    rendered = value.render() if isinstance(value, ShellExpansion) else shlex.quote(value)
    return f"export {name}={rendered}"


def remote_path(path: str) -> str:
    """A quoted path; a relative one is under the remote ``$HOME``, as the tutorials' ``maxtext_venv``."""
    if path.startswith("/"):
        return shlex.quote(path)
    return f'"$HOME"/{shlex.quote(path)}'
