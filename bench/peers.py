"""The peers' protections of bench/app.py's view, for the side-by-side rounds.

* ``POST /powertools`` (variants g and gr): AWS Lambda Powertools' ``idempotent_function``
  with its Redis persistence layer (``CachePersistenceLayer``) on the benchmark's own
  ``redis-server``, wrapped around the same view body. The Idempotency-Key is the
  idempotency key (``event_key_jmespath``). A replay answers the stored result with
  ``Idempotent-Replayed: true`` (Powertools' ``response_hook`` runs only on replays), a
  twin in flight gets 409, as with ``@idempotent``.

  Without payload validation, so a retry with another body is not detected (the
  extension's fingerprint does that): in aws-lambda-powertools 3.37.0 the Redis layer's
  ``_update_record`` rewrites the record without its validation hash, so with
  ``payload_validation_jmespath`` set every replay of a completed key fails with
  ``IdempotencyValidationError`` (the TypeScript port had and fixed the same bug).
* Flask-Idempotent (2015, variant h) is only probed: whether it imports on this Flask.

Each peer's state is one line of ``peer_status()``: ``"ready"`` or why not.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, jsonify, request

Work = Callable[[str], tuple[dict[str, Any], int]]


def peer_status(app: Flask) -> dict[str, str]:
    status: dict[str, str] = app.extensions.get("bench_peers", {})
    return status


def register(app: Flask, work: Work) -> None:
    """Add the peers' routes that can run here; record why the others cannot."""
    status: dict[str, str] = {}
    app.extensions["bench_peers"] = status
    redis_url = os.environ.get("BENCH_REDIS_URL", "")
    if not redis_url:
        status["powertools"] = "no redis-server (BENCH_REDIS_URL is not set)"
    else:
        try:
            add_powertools(app, work, redis_url)
        except ImportError as exc:
            status["powertools"] = f"{type(exc).__name__}: {exc}"
        else:
            status["powertools"] = "ready"
    status["flask_idempotent"] = probe_flask_idempotent()


def probe_flask_idempotent() -> str:
    """Flask-Idempotent 0.1.0 is measured only if it imports; it says why not."""
    try:
        import flask_idempotent  # type: ignore[import-not-found,import-untyped,unused-ignore] # noqa: F401
    except Exception as exc:  # it fails at import time on current Flask and Jinja
        return f"{type(exc).__name__}: {exc}"
    return "imports, but bench/peers.py does not wire it (see docs/performance-history.md)"


def add_powertools(app: Flask, work: Work, redis_url: str) -> None:
    import redis

    # Powertools comes with the bench extra (setup.cfg), which the dev environment that
    # type-checks bench/ lacks: there these names are Any; where it is installed the ignores
    # go unused (unused-ignore).
    from aws_lambda_powertools.utilities.idempotency import (  # type: ignore[import-not-found, unused-ignore]
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.exceptions import (  # type: ignore[import-not-found, unused-ignore]
        IdempotencyAlreadyInProgressError,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (  # type: ignore[import-not-found, unused-ignore]
        CachePersistenceLayer,
    )

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with warnings.catch_warnings():
        # 3.x: CachePersistenceLayer is an alias of the deprecated RedisCachePersistenceLayer
        warnings.simplefilter("ignore", DeprecationWarning)
        # redis-py's Redis.set takes ex: int, Powertools' RedisClientProtocol says float: the two
        # libraries' annotations disagree (it runs); without Powertools the ignore is unused.
        layer = CachePersistenceLayer(client=client)  # type: ignore[arg-type, unused-ignore]

    def replayed(response: dict[str, Any], idempotent_data: Any) -> dict[str, Any]:
        """The IdempotentHookFunction protocol's (idempotent_data: a DataRecord)."""
        return {**response, "replayed": True}

    config = IdempotencyConfig(
        event_key_jmespath="key",
        expires_after_seconds=86400,  # the extension's default IDEMPOTENCY_TTL
        response_hook=replayed,
    )

    def run_view(call: dict[str, Any]) -> dict[str, Any]:
        payload, status = work("powertools")
        return {"status": status, "body": payload}

    # The decorator, applied by hand: idempotent_function returns Any, the view stays typed.
    idempotent_view: Callable[..., dict[str, Any]] = idempotent_function(
        data_keyword_argument="call", persistence_store=layer, config=config
    )(run_view)

    @app.post("/powertools")
    def powertools() -> Response | tuple[dict[str, Any], int]:
        key = request.headers.get("Idempotency-Key")
        if not key:
            return {"error": "Idempotency-Key required"}, 400
        call = {
            "key": key,
            "request": {
                "method": request.method,
                "path": request.path,
                "body": request.get_json(silent=True),
            },
        }
        try:
            result = idempotent_view(call=call)
        except IdempotencyAlreadyInProgressError:
            return {"error": "request in progress"}, 409
        response = jsonify(result["body"])  # app.json.response, typed as flask's Response
        response.status_code = result["status"]
        if result.get("replayed"):
            response.headers["Idempotent-Replayed"] = "true"
        return response
