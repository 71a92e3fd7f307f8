"""Files only their owner may read: nkey seeds, API keys and tokens.

Written whole or not at all (write, fsync, rename) with mode 0600 in a 0700 directory;
read only while nobody else can read them, because whoever copied one is its owner to
the server that checks it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from m27.common.errors import ConfigError


def write_secret(path: Path, data: bytes) -> None:
    """Write-then-rename `data` into `path` (0600; its directory made 0700 if new)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def read_secret(path: Path, what: str, hint: str = "") -> bytes:
    """The file's content, stripped; ConfigError (naming `what`, and `hint` for a missing
    file) when it cannot be read or others than its owner can read it."""
    try:
        info = path.stat()
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}"
                          + (f" ({hint})" if hint else "")) from exc
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the {what} {path} can be read by others (mode "
                          f"{stat.filemode(info.st_mode)}); `chmod 600 {path.name}`")
    return data.strip()
