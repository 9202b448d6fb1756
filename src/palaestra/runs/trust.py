"""Signed run pickles: a run's ``config.pkl`` carries code (the reward, an environment, a
dataset class shipped by value), and loading it runs that code. The training worker and
``resume()`` load only what this palaestra home wrote, or what its user trusted explicitly.

The format, owned here::

    palaestra-signed-v1 <hex HMAC-SHA256 of the payload>\\n<payload: the cloudpickle bytes>

The key is 32 random bytes in ``<home>/trust.key`` (mode 0600), made on first use, the way a
notebook server signs the notebooks its user ran. A run folder copied from another home, or a
pickle changed after it was written, no longer matches and is refused with what to do.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from palaestra.atomic import write_bytes_atomic
from palaestra.home import palaestra_home

MAGIC = b"palaestra-signed-v1 "
KEY_FILE = "trust.key"


class UntrustedPickleError(RuntimeError):
    """A run pickle this palaestra home did not write (or that changed since)."""


def home_key(home: Path | None = None) -> bytes:
    """This home's signing key, created (readable by its owner only) on first use."""
    path = (home or palaestra_home()) / KEY_FILE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        # Another process may read the file between its creation and this write: it then
        # sees fewer than 32 bytes, and waits below until the key is whole.
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(secrets.token_bytes(32))
            handle.flush()
            os.fsync(handle.fileno())
    for _ in range(1000):
        key = path.read_bytes()
        if len(key) == 32:
            return key
    raise UntrustedPickleError(f"{path} is not a 32-byte key; delete it to make a new one")


def _signature(payload: bytes, home: Path | None) -> bytes:
    return hmac.new(home_key(home), payload, hashlib.sha256).hexdigest().encode()


def write_signed(path: Path, payload: bytes, home: Path | None = None) -> None:
    """Write ``payload`` to ``path`` (atomically) with this home's signature."""
    write_bytes_atomic(path, MAGIC + _signature(payload, home) + b"\n" + payload)


def _split(data: bytes) -> tuple[bytes | None, bytes]:
    """(signature, payload); an unsigned file is all payload."""
    if not data.startswith(MAGIC):
        return None, data
    header, _, payload = data.partition(b"\n")
    return header[len(MAGIC) :], payload


def read_signed(path: Path, home: Path | None = None) -> bytes:
    """The payload of ``path`` if this home signed it; else UntrustedPickleError saying why
    and how to trust it."""
    signature, payload = _split(path.read_bytes())
    if signature is None:
        why = "is not signed (written by an older palaestra, or by hand)"
    elif not hmac.compare_digest(signature, _signature(payload, home)):
        why = "was not signed by this palaestra home, or was changed after it was written"
    else:
        return payload
    where = home or palaestra_home()
    raise UntrustedPickleError(
        f"{path} {why}. Loading it would run the code it carries (the reward, the dataset, "
        f"any environment), so it is refused under {where}. If you trust whoever made it, "
        f"sign it for this home with `palaestra run trust {path.parent.name}` (or "
        "palaestra.runs.trust.trust(path)) and try again."
    )


def verify(path: Path, home: Path | None = None) -> None:
    """Raise UntrustedPickleError unless ``path`` is signed by this home."""
    read_signed(path, home)


def trust(path: Path, home: Path | None = None) -> None:
    """Sign ``path``'s payload with this home's key: the user vouches for its code."""
    _, payload = _split(path.read_bytes())
    write_signed(path, payload, home)
