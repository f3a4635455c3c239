"""The requests side of the client: :class:`IdempotentAdapter`, imported by
``flask_idempotency.client`` when first asked for (requests is the ``client`` extra)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping

from requests import PreparedRequest, Response, exceptions
from requests.adapters import DEFAULT_POOLBLOCK, DEFAULT_POOLSIZE, HTTPAdapter

from .policy import KEY_HEADER, Attempts, RetryPolicy, label, new_key

#: errors after which the request may or may not have run: the same key makes a retry safe
RETRIED_ERRORS = (exceptions.ConnectionError, exceptions.Timeout, exceptions.ChunkedEncodingError)
#: ConnectionErrors that the next attempt would meet alike
NOT_RETRIED_ERRORS = (exceptions.SSLError, exceptions.ProxyError)


def _replayable(request: PreparedRequest) -> bool:
    """Make the body sendable again (a file is read into memory); False for a body of
    unknown length (a generator, sent chunked), which can be sent only once."""
    if "chunked" in str(request.headers.get("Transfer-Encoding", "")).lower():
        return False
    body = request.body
    read = getattr(body, "read", None)
    if callable(read):  # a file, which requests sends with its Content-Length
        request.body = read()
    return True


def _after(response: Response, attempts: Attempts) -> float | None:
    """Seconds before the next attempt after *response*, or None to return it."""
    return attempts.after_answer(
        response.status_code, response.headers, lambda: response.content, response
    )


class IdempotentAdapter(HTTPAdapter):
    """A requests transport adapter that makes ``POST`` and ``PATCH`` safe to retry, and
    retries them. Mount it on a :class:`requests.Session`:

    .. code-block:: python

        import requests
        from flask_idempotency.client import IdempotentAdapter

        session = requests.Session()
        session.mount("https://", IdempotentAdapter())
        session.post("https://payments/charges", json={"amount": 100})

    It decides as :class:`IdempotentTransport` does: one ``Idempotency-Key`` (a UUID4) per
    request of *methods* that has none, kept across its attempts; a caller's key is kept;
    retries after connection errors, timeouts and retryable answers (409 ``retryable``, 429,
    503, a 5xx with ``Stripe-Should-Retry: true``), each retry saying when the request was
    first sent (``Repeatability-First-Sent``); a 409 ``key-expired`` raises
    :class:`KeyExpired`; every other answer, and every other method, as it came. A file body
    is read into memory so that every attempt sends it; a generator body (sent chunked) gets
    its key and is sent once. Unless the request is sent with ``stream=True``, the answer is
    read whole within its attempt, so a connection that drops mid-answer is retried too.

    :param max_attempts: attempts per request, the first included.
    :param max_elapsed: seconds, counted from the first attempt, within which a retry may
        start; a wait that would end later is not made and the last answer is returned (or
        the last error raised). An attempt's own length is bounded by the request's
        ``timeout=`` (requests has none by default: give one).
    :param backoff: the first wait's ceiling, in seconds; it doubles with each attempt
        (full jitter: the wait is a random fraction of the ceiling).
    :param max_backoff: the largest wait, in seconds, also for the server's ``Retry-After``.
    :param methods: the methods that get a key and are retried.
    :param sleep: called with the seconds to wait between attempts.
    :param random: returns a float in [0, 1), the jitter.
    :param pool_connections: passed to :class:`requests.adapters.HTTPAdapter`.
    :param pool_maxsize: passed to :class:`requests.adapters.HTTPAdapter`.
    :param pool_block: passed to :class:`requests.adapters.HTTPAdapter`.
    """

    # HTTPAdapter pickles only the attributes named here
    __attrs__ = [*HTTPAdapter.__attrs__, "policy", "_sleep", "_random"]

    def __init__(
        self,
        *,
        max_attempts: int = 5,
        max_elapsed: float = 30.0,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        methods: Iterable[str] = ("POST", "PATCH"),
        sleep: Callable[[float], None] = time.sleep,
        random: Callable[[], float] = random.random,
        pool_connections: int = DEFAULT_POOLSIZE,
        pool_maxsize: int = DEFAULT_POOLSIZE,
        pool_block: bool = DEFAULT_POOLBLOCK,
    ) -> None:
        self.policy = RetryPolicy.checked(max_attempts, max_elapsed, backoff, max_backoff, methods)
        self._sleep = sleep
        self._random = random
        # urllib3's own retries stay off (max_retries=0): they would retry without asking
        # the server's answer, and multiply the attempts
        super().__init__(
            pool_connections=pool_connections, pool_maxsize=pool_maxsize, pool_block=pool_block
        )

    def send(
        self,
        request: PreparedRequest,
        stream: bool = False,
        timeout: float | tuple[float | None, float | None] | None = None,
        verify: bool | str = True,
        cert: str | tuple[str, str] | None = None,
        proxies: Mapping[str, str] | None = None,
    ) -> Response:
        """Send *request*, again while its answer or error is retryable and the budget
        lasts; the arguments are :meth:`requests.adapters.HTTPAdapter.send`'s."""

        def attempt() -> Response:
            return HTTPAdapter.send(
                self,
                request,
                stream=stream,
                timeout=timeout,
                verify=verify,
                cert=cert,
                proxies=None if proxies is None else dict(proxies),
            )

        if not self.policy.covers(request.method or ""):
            return attempt()
        if KEY_HEADER not in request.headers:
            request.headers[KEY_HEADER] = new_key()
        if not _replayable(request):
            return attempt()
        key = str(request.headers[KEY_HEADER])
        attempts = Attempts(self.policy, self._random, label(request.method, request.url, key), key)
        while True:
            attempts.attempt()
            request.headers.update(attempts.retry_headers())
            try:
                response = attempt()
                if not stream:
                    response.content  # noqa: B018 - read within the attempt
            except NOT_RETRIED_ERRORS:
                raise
            except RETRIED_ERRORS as exc:
                if (wait := attempts.after_error(exc)) is None:
                    raise
            else:
                if (wait := _after(response, attempts)) is None:
                    return response
                response.close()
            self._sleep(wait)
