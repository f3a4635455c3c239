"""Encryptors for ``IDEMPOTENCY_ENCRYPTOR``: what stored bodies and headers are
encrypted with at rest.

Any object with ``encrypt(bytes) -> bytes`` and ``decrypt(bytes) -> bytes`` will do
(a KMS envelope, a vault client); :class:`Fernet` is the one shipped, with key
rotation. Install it with the ``crypto`` extra (``cryptography``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError


@runtime_checkable
class Encryptor(Protocol):
    """What ``IDEMPOTENCY_ENCRYPTOR`` must be. ``decrypt`` raises (any exception) on
    data it did not encrypt or cannot authenticate."""

    def encrypt(self, data: bytes) -> bytes:
        """*data*, encrypted."""

    def decrypt(self, data: bytes) -> bytes:
        """What :meth:`encrypt` was given; raises if *data* is not its work."""


def check_encryptor(value: Any) -> Any:
    """Check ``IDEMPOTENCY_ENCRYPTOR``: None, or an object with ``encrypt`` and ``decrypt``."""
    if value is None:
        return None
    # A class has the methods too, unbound: the first request would fail, not start-up.
    if isinstance(value, type) or not all(
        callable(getattr(value, method, None)) for method in ("encrypt", "decrypt")
    ):
        got = f"the class {value.__name__}" if isinstance(value, type) else type(value).__name__
        raise ValueError(
            "must be an object with encrypt(bytes) -> bytes and decrypt(bytes) -> bytes (such"
            f" as flask_idempotency.encryption.Fernet([key, ...])), got {got}"
        )
    return value


class Fernet:
    """Fernet (AES-128-CBC with HMAC-SHA256, from ``cryptography``) with key rotation:
    encrypts with the first of *keys*, decrypts with any of them.

    To rotate: put a new key first and keep the old ones after it; once every key
    stored under an old key has expired (``IDEMPOTENCY_TTL``), drop that key.

    .. code-block:: python

        from flask_idempotency.encryption import Fernet

        app.config["IDEMPOTENCY_ENCRYPTOR"] = Fernet([os.environ["IDEMPOTENCY_KEY_2"],
                                                      os.environ["IDEMPOTENCY_KEY_1"]])

    :param keys: URL-safe base64 32-byte keys, as ``cryptography.fernet.Fernet.generate_key()``
        makes them, newest first.
    :raises ConfigError: no keys, a key that is not a Fernet key, or a single string
        where a list is meant.
    :raises ImportError: ``cryptography`` is not installed (the ``crypto`` extra).
    """

    def __init__(self, keys: Sequence[str | bytes]) -> None:
        try:
            from cryptography import fernet
        except ImportError as exc:  # pragma: no cover - the crypto extra is installed in CI
            raise ImportError(
                "flask_idempotency.encryption.Fernet needs 'cryptography':"
                " pip install 'flask-idempotency[crypto]'"
            ) from exc
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise ConfigError("Fernet(keys) takes a list of keys, newest first.")
        if not keys:
            raise ConfigError("Fernet(keys) needs at least one key.")
        ciphers = []
        for number, key in enumerate(keys, 1):
            try:
                ciphers.append(fernet.Fernet(key))
            except (TypeError, ValueError):
                # Never the key itself in a message: it may end up in a log.
                raise ConfigError(
                    f"Fernet key #{number} is not a Fernet key (32 url-safe base64-encoded"
                    " bytes, as cryptography.fernet.Fernet.generate_key() makes)."
                ) from None
        self._fernet: Any = fernet.MultiFernet(ciphers)
        self.key_count = len(ciphers)

    def encrypt(self, data: bytes) -> bytes:
        """*data* encrypted with the first key."""
        token: bytes = self._fernet.encrypt(data)
        return token

    def decrypt(self, data: bytes) -> bytes:
        """*data* decrypted with whichever key encrypted it.

        :raises cryptography.fernet.InvalidToken: no key decrypts it, or it was altered.
        """
        plain: bytes = self._fernet.decrypt(data)
        return plain

    def __repr__(self) -> str:
        return f"<Fernet with {self.key_count} key(s)>"
