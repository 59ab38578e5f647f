"""The OpenRouter API key: read at run time from a file or `OPENROUTER_API_KEY`, never shown.

The key is never a notebook parameter (executed notebooks are saved), so callers get it from here
at the moment they open a connection. `ApiKey` hides itself from repr/str/format so that a stray
`print`, log line or exception message cannot leak it; use `.reveal()` only to build the header.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "OPENROUTER_API_KEY"


class ApiKey:
    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str):
        self._value = value
        self.source = source

    def reveal(self) -> str:
        return self._value

    def header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._value}"}

    def __repr__(self) -> str:
        return f"ApiKey(<hidden>, from {self.source})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __reduce__(self):
        raise TypeError("ApiKey must not be pickled or saved")


def read_api_key(api_key_file: str | os.PathLike | None = None) -> ApiKey:
    """The key from `api_key_file` if given, else from the environment. Errors name the source,
    never the content."""
    if api_key_file:
        path = Path(api_key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"api_key_file {str(path)!r} does not exist")
        value = path.read_text(encoding="utf-8").strip()
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"api_key_file {str(path)!r} must hold exactly one key on one line")
        return ApiKey(value, f"file {path}")
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        raise RuntimeError(f"no API key: set api_key_file in the params or the {ENV_VAR} environment variable")
    return ApiKey(value, f"${ENV_VAR}")


def api_key_for(api_base: str, api_key_file: str | os.PathLike | None = None) -> ApiKey:
    """The key for `api_base`. OpenRouter (https) needs one; a serving engine on plain http (a local
    vLLM or SGLang started without --api-key) may have none: then a placeholder is sent, as
    OpenAI-compatible clients do."""
    if api_key_file or os.environ.get(ENV_VAR, "").strip() or not api_base.startswith("http://"):
        return read_api_key(api_key_file)
    return ApiKey("EMPTY", f"no key (a plain-http engine at {api_base})")
