"""Show, against the running example server, what a retrying client sees.

python example/client.py [http://127.0.0.1:8000]
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
import uuid


def post(
    base: str, key: str, body: dict[str, object]
) -> tuple[int, dict[str, str], dict[str, object]]:
    request = urllib.request.Request(
        base + "/payments",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            "X-API-Key": "demo-shop",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def show(title: str, result: tuple[int, dict[str, str], dict[str, object]]) -> None:
    status, headers, body = result
    replayed = "  (replayed)" if headers.get("Idempotent-Replayed") == "true" else ""
    retry = f"  Retry-After: {headers['Retry-After']}" if "Retry-After" in headers else ""
    print(f"{title:<34} -> {status}{replayed}{retry}")
    summary = body.get("id") or body.get("type")
    print(f"{'':<34}    {summary}  {body.get('detail', '')}".rstrip())


def main() -> None:
    base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    key = f"order-{uuid.uuid4().hex[:8]}"
    print(f"Idempotency-Key: {key}\n")
    show("1. first request", post(base, key, {"amount": 1000}))
    show("2. retry, same body", post(base, key, {"amount": 1000}))
    show("3. same key, another amount", post(base, key, {"amount": 5}))

    race_key = f"order-{uuid.uuid4().hex[:8]}"
    results: list[tuple[int, dict[str, str], dict[str, object]]] = []
    threads = [
        threading.Thread(target=lambda: results.append(post(base, race_key, {"amount": 700})))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"\n4. three requests at once with {race_key}:")
    for number, result in enumerate(sorted(results, key=lambda r: r[0]), 1):
        show(f"   request {number}", result)
    show("5. retry once they are done", post(base, race_key, {"amount": 700}))


if __name__ == "__main__":
    main()
