"""The httpx side of the client: :class:`IdempotentTransport` and its async twin, imported by
``flask_idempotency.client`` when first asked for (httpx is the ``client`` extra)."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Iterable

import anyio
import httpx

from .policy import KEY_HEADER, Attempts, RetryPolicy, label, new_key

#: errors after which the request may or may not have run: the same key makes a retry safe.
#: Not retried: LocalProtocolError, UnsupportedProtocol, ProxyError (the next attempt fails
#: alike), DecodingError (the server answered).
RETRIED_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


def _streamed(request: httpx.Request) -> bool:
    """Whether the body has no known length (a generator): httpx then sends it chunked, and
    it cannot be sent again."""
    return "chunked" in request.headers.get("Transfer-Encoding", "").lower()


def _in_memory(response: httpx.Response) -> httpx.Response:
    """*response* with its body read whole, within the attempt (so that a connection that
    drops mid-answer is retried too), handed on to the client as if just received."""
    if response.is_stream_consumed:  # the wrapped transport built it in memory
        return response
    try:
        raw = b"".join(response.iter_raw())
    finally:
        response.close()
    return _rebuilt(response, raw)


async def _in_memory_async(response: httpx.Response) -> httpx.Response:
    """:func:`_in_memory` for an async transport."""
    if response.is_stream_consumed:
        return response
    try:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()
    return _rebuilt(response, raw)


def _rebuilt(response: httpx.Response, raw: bytes) -> httpx.Response:
    # Not read: the client reads it as any answer, which sets .elapsed and decodes it.
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        extensions=response.extensions,
    )


def _body(response: httpx.Response) -> bytes:
    """The decoded body of a response of :func:`_in_memory`, which stays unread."""
    if response.is_stream_consumed:
        return response.content
    # a ByteStream yields its bytes on every iteration: a throwaway response decodes them
    return httpx.Response(
        response.status_code, headers=response.headers, stream=response.stream
    ).read()


def _after(response: httpx.Response, attempts: Attempts) -> float | None:
    """Seconds before the next attempt after *response*, or None to return it."""
    return attempts.after_answer(
        response.status_code, response.headers, lambda: _body(response), response
    )


class _Settings:
    """The arguments both transports take, checked once."""

    def __init__(
        self,
        max_attempts: int,
        max_elapsed: float,
        backoff: float,
        max_backoff: float,
        methods: Iterable[str],
        random: Callable[[], float],
    ) -> None:
        self.policy = RetryPolicy.checked(max_attempts, max_elapsed, backoff, max_backoff, methods)
        self._random = random

    def _start(self, request: httpx.Request) -> Attempts | None:
        """Give *request* its key; the attempts to count if it may be retried, else None."""
        if not self.policy.covers(request.method):
            return None
        if KEY_HEADER not in request.headers:
            request.headers[KEY_HEADER] = new_key()
        if _streamed(request):
            return None
        key = request.headers[KEY_HEADER]
        return Attempts(self.policy, self._random, label(request.method, request.url, key), key)


class IdempotentTransport(_Settings, httpx.BaseTransport):
    """An httpx transport that makes ``POST`` and ``PATCH`` safe to retry, and retries them.

    .. code-block:: python

        import httpx
        from flask_idempotency.client import IdempotentTransport

        client = httpx.Client(transport=IdempotentTransport(), base_url="https://payments")
        client.post("/charges", json={"amount": 100})  # one key, however many attempts

    A request whose method is in *methods* and that has no ``Idempotency-Key`` gets one (a
    UUID4), which all its attempts send; a key the caller set is kept. It is retried after a
    connection error or a timeout, and after an answer the server marks retryable: a 409
    whose problem says ``retryable: true`` (or with ``Stripe-Should-Retry: true``), 429, 503,
    and any 5xx with ``Stripe-Should-Retry: true``; each retry says when the request was first
    sent (``Repeatability-First-Sent``). A 409 ``key-expired`` raises :class:`KeyExpired`.
    Every other answer, among them 422 and a 409 ``outcome-unknown``, is returned as it
    came. Requests of other methods pass through
    untouched.

    The body is buffered so that every attempt sends it again; a body of unknown length (a
    generator, which httpx sends chunked) cannot be, so such a request gets its key and is
    sent once. The answer of a retried method is read whole within its attempt.

    :param transport: the transport that sends each attempt; by default a new
        :class:`httpx.HTTPTransport`. Closing this transport closes it.
    :param max_attempts: attempts per request, the first included.
    :param max_elapsed: seconds, counted from the first attempt, within which a retry may
        start; a wait that would end later is not made and the last answer is returned (or
        the last error raised). An attempt's own length is bounded by the client's timeout.
    :param backoff: the first wait's ceiling, in seconds; it doubles with each attempt
        (full jitter: the wait is a random fraction of the ceiling).
    :param max_backoff: the largest wait, in seconds, also for the server's ``Retry-After``.
    :param methods: the methods that get a key and are retried.
    :param sleep: called with the seconds to wait between attempts.
    :param random: returns a float in [0, 1), the jitter.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        max_attempts: int = 5,
        max_elapsed: float = 30.0,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        methods: Iterable[str] = ("POST", "PATCH"),
        sleep: Callable[[float], None] = time.sleep,
        random: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(max_attempts, max_elapsed, backoff, max_backoff, methods, random)
        self.transport = transport if transport is not None else httpx.HTTPTransport()
        self._sleep = sleep

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send *request*, again while its answer or error is retryable and the budget lasts."""
        attempts = self._start(request)
        if attempts is None:
            return self.transport.handle_request(request)
        request.read()  # buffered once: every attempt sends the same bytes
        while True:
            attempts.attempt()
            request.headers.update(attempts.retry_headers())
            try:
                response = _in_memory(self.transport.handle_request(request))
            except RETRIED_ERRORS as exc:
                if (wait := attempts.after_error(exc)) is None:
                    raise
            else:
                if (wait := _after(response, attempts)) is None:
                    return response
            self._sleep(wait)

    def close(self) -> None:
        """Close the wrapped transport."""
        self.transport.close()


IdempotentTransport.__module__ = "flask_idempotency.client"


class AsyncIdempotentTransport(_Settings, httpx.AsyncBaseTransport):
    """:class:`IdempotentTransport` for :class:`httpx.AsyncClient`: the same arguments and
    behaviour, with an async *transport* (by default a new :class:`httpx.AsyncHTTPTransport`)
    and an async *sleep* (by default :func:`anyio.sleep`, so asyncio and trio both work).
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        max_attempts: int = 5,
        max_elapsed: float = 30.0,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        methods: Iterable[str] = ("POST", "PATCH"),
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        random: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(max_attempts, max_elapsed, backoff, max_backoff, methods, random)
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send *request*, again while its answer or error is retryable and the budget lasts."""
        attempts = self._start(request)
        if attempts is None:
            return await self.transport.handle_async_request(request)
        await request.aread()
        while True:
            attempts.attempt()
            request.headers.update(attempts.retry_headers())
            try:
                response = await _in_memory_async(
                    await self.transport.handle_async_request(request)
                )
            except RETRIED_ERRORS as exc:
                if (wait := attempts.after_error(exc)) is None:
                    raise
            else:
                if (wait := _after(response, attempts)) is None:
                    return response
            await self._sleep(wait)

    async def aclose(self) -> None:
        """Close the wrapped transport."""
        await self.transport.aclose()


AsyncIdempotentTransport.__module__ = "flask_idempotency.client"
