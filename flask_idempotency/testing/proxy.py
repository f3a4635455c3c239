"""A TCP proxy on 127.0.0.1 that can be told to go silent: a network partition, or a
pooler that hangs, between the app and its database. It forwards to a TCP address or to a
PostgreSQL server's Unix socket (a *target_host* that is a directory, as libpq's ``host``);
given *listen_path*, it listens on that Unix-domain socket instead of 127.0.0.1.

While :meth:`TcpProxy.freeze` is in effect the proxy accepts connections and bytes but
forwards nothing in either direction, so the peers see a connection that is up and
says nothing; :meth:`TcpProxy.thaw` lets the held bytes through again.

It also counts round trips (:attr:`TcpProxy.round_trips`): each time a client sends
after its server last spoke (or first), so a pipeline of statements sent together is one;
the statements clients sent (:attr:`TcpProxy.statements`: the protocol's Execute and
simple Query messages, a pipeline's each); and the connections it forwarded
(:attr:`TcpProxy.connections`).

:meth:`TcpProxy.drop_answers` loses answers instead: the server has done its work and sent
its answer, and the client sees its connection close without one.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .postgres import free_port
from .service import Service


class TcpProxy(Service):
    """Forwards 127.0.0.1:*port* to *target_host*:*target_port*, one thread per direction.

    A *target_host* that starts with ``/`` is a socket directory, as libpq reads ``host``:
    the proxy forwards to the Unix socket ``<target_host>/.s.PGSQL.<target_port>`` (one
    that starts with ``@``, to that socket in Linux's abstract namespace).

    Given *listen_path*, it listens on that Unix-domain socket instead (created by
    :meth:`__init__`, removed by :meth:`stop`; :attr:`port` is then 0). Named
    ``<directory>/.s.PGSQL.<port>``, it is what libpq connects to with ``host=<directory>``
    and ``port=<port>``, and :meth:`url` says so.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        #: the Unix socket forwarded to, or None for a TCP target
        self.unix_path: str | None = None
        if target_host.startswith(("/", "@")):
            path = f"{target_host}/.s.PGSQL.{target_port}"
            self.unix_path = "\0" + path[1:] if path.startswith("@") else path
        #: the Unix-domain socket listened on, or None: 127.0.0.1:`port`
        self.listen_path = os.fspath(listen_path) if listen_path is not None else None
        self._flowing = threading.Event()
        self._flowing.set()
        self._stopping = threading.Event()
        if self.listen_path is None:
            self.port = free_port()
            self._listener = socket.create_server(("127.0.0.1", self.port))
        else:
            self.port = 0
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._listener.bind(self.listen_path)
                self._listener.listen(64)
            except OSError:
                self._listener.close()
                raise
        self._listener.settimeout(0.1)
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        #: client sends that followed an answer (or came first), on every connection
        self.round_trips = 0
        #: Execute and simple Query messages from clients, on every connection
        self.statements = 0
        #: connections accepted and forwarded
        self.connections = 0
        self._client_spoke_last: dict[int, bool] = {}
        self._messages: dict[int, FrontendMessages] = {}
        self._answers_to_drop = 0
        self._answers_to_pass = 0
        #: the connections open now (by their client socket's id), and until when what
        #: their clients send is held (:meth:`stall`)
        self._open: set[int] = set()
        self._stalled: dict[int, float] = {}

    @classmethod
    def to_database(cls, database_url: str) -> TcpProxy:
        """A proxy to the server *database_url* names by its ``host`` and ``port`` (a
        socket directory too; no host: 127.0.0.1). See :meth:`to_server` for the server
        a connection reaches."""
        params = conninfo_to_dict(database_url)
        return cls(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))

    @classmethod
    def to_server(cls, database_url: str, connect_timeout: int = 10) -> TcpProxy:
        """A proxy to the server a connection to *database_url* reaches, as libpq finds
        it: the default socket directory of a URL without a host
        (``postgresql:///myapp``), ``PGHOST``, the first host of a list that answers, a
        ``hostaddr``."""
        import psycopg

        with psycopg.connect(database_url, connect_timeout=connect_timeout) as conn:
            info = conn.info
            return cls(info.hostaddr or info.host, info.port)

    def url(self, database_url: str) -> str:
        """*database_url* pointing at this proxy instead (its TCP address on 127.0.0.1, or
        the directory and port of a *listen_path* named ``.s.PGSQL.<port>``)."""
        params = conninfo_to_dict(database_url)
        params.pop("hostaddr", None)
        if self.listen_path is None:
            params.update(host="127.0.0.1", port=str(self.port))
        else:
            directory, name = os.path.split(self.listen_path)
            named = re.fullmatch(r"\.s\.PGSQL\.(\d+)", name)
            if named is None:
                raise ValueError(f"libpq cannot name {self.listen_path}: not .s.PGSQL.<port>")
            params.update(host=directory, port=named[1])
        return make_conninfo("", **params)

    def start(self) -> None:
        self._spawn(self._accept)

    def freeze(self) -> None:
        """Stop forwarding: bytes already sent, and new ones, wait in the proxy."""
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def stall(self, seconds: float) -> None:
        """Hold what the clients of the connections open now send for *seconds* from now,
        then forward it, in order; connections opened later flow. A partition that heals
        with a client's bytes still on their way: they reach the server after the client
        gave up on them, while its new connections are answered at once."""
        until = time.monotonic() + seconds
        with self._lock:
            self._stalled.update({pair: until for pair in self._open})

    def drop_answers(self, count: int = 1, *, after: int = 0) -> None:
        """Lose the next *count* answers, once *after* more have passed: on the first bytes a
        server sends after its client spoke, the proxy forwards nothing and closes both sides
        of that connection."""
        with self._lock:
            self._answers_to_drop = count
            self._answers_to_pass = after

    def _drops(self, pair: int, from_client: bool) -> bool:
        """Whether these bytes, just read, start an answer to be dropped."""
        with self._lock:
            starts_answer = not from_client and self._client_spoke_last.get(pair, False)
            if starts_answer and self._answers_to_drop > 0:
                if self._answers_to_pass > 0:
                    self._answers_to_pass -= 1
                    return False
                self._answers_to_drop -= 1
                return True
            return False

    def stop(self) -> None:
        self._stopping.set()
        self._flowing.set()
        self._listener.close()
        if self.listen_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.listen_path)
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        for thread in threads:
            thread.join(10)
        assert not any(t.is_alive() for t in threads)
        # Only now: the accept thread may have added a pair after the shutdowns above.
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = self._connect()
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
                self.connections += 1
                self._open.add(id(client))
            if self._stopping.is_set():  # stop() is closing them
                return
            self._spawn(self._pump, client, upstream, id(client), True)
            self._spawn(self._pump, upstream, client, id(client), False)

    def _connect(self) -> socket.socket:
        """A connection to the target."""
        if self.unix_path is None:
            return socket.create_connection(self.target, timeout=5)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.settimeout(5)
            upstream.connect(self.unix_path)
        except OSError:
            upstream.close()
            raise
        return upstream

    def _count(self, pair: int, from_client: bool, data: bytes) -> None:
        with self._lock:
            if from_client and not self._client_spoke_last.get(pair, False):
                self.round_trips += 1
            self._client_spoke_last[pair] = from_client
            if from_client:
                self.statements += self._messages.setdefault(pair, FrontendMessages()).feed(data)

    def _pump(
        self, source: socket.socket, sink: socket.socket, pair: int, from_client: bool
    ) -> None:
        try:
            source.settimeout(0.1)
        except OSError:  # stop() closed the socket before this thread started
            return
        while not self._stopping.is_set():
            self._flowing.wait()
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data or self._drops(pair, from_client):
                break
            self._count(pair, from_client, data)
            # Bytes read just before a freeze are held until the thaw too.
            while not self._flowing.wait(0.1):
                if self._stopping.is_set():
                    return
            if from_client and self._held_back(pair):
                return
            try:
                sink.sendall(data)
            except OSError:
                break
        with self._lock:
            self._open.discard(pair)
            self._stalled.pop(pair, None)
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _held_back(self, pair: int) -> bool:
        """Wait out the stall of connection *pair* (:meth:`stall`); True if the proxy
        stopped meanwhile."""
        with self._lock:
            until = self._stalled.get(pair, 0.0)
        while time.monotonic() < until:
            if self._stopping.wait(min(0.05, until - time.monotonic())):
                return True
        return False


class FrontendMessages:
    """What a client sends on one connection, read as PostgreSQL's protocol: the untyped
    requests before the startup message (SSL, GSS encryption), then typed messages
    (a type byte, then a length that counts itself). :meth:`feed` says how many statements
    the bytes finished sending: Execute (``E``) and simple Query (``Q``) messages."""

    #: the startup message's protocol versions (3.0, 3.2): typed messages follow it
    _STARTUP = (3 << 16, (3 << 16) | 2)
    #: the requests that may come before it: cancel, SSL, GSS encryption
    _REQUESTS = (80877102, 80877103, 80877104)

    #: PostgreSQL's largest message
    _LONGEST = 1 << 30

    def __init__(self) -> None:
        self._pending = b""
        self._started = False
        #: what came is not the protocol in the clear (TLS, or garbage): no more counting
        self.lost = False

    def feed(self, data: bytes) -> int:
        if self.lost:
            return 0
        self._pending += data
        statements = 0
        while True:
            header, code = (5 if self._started else 8), 0
            if len(self._pending) < header:
                return statements
            if self._started:
                kind, length = self._pending[:1], int.from_bytes(self._pending[1:5], "big") + 1
            else:
                kind, length = b"", int.from_bytes(self._pending[:4], "big")
                code = int.from_bytes(self._pending[4:8], "big")
                if code not in self._STARTUP + self._REQUESTS:
                    length = 0  # TLS after an SSL request, or not PostgreSQL
            if not header <= length <= self._LONGEST:
                self.lost, self._pending = True, b""
                return statements
            if len(self._pending) < length:
                return statements
            self._started = self._started or code in self._STARTUP
            statements += kind in (b"E", b"Q")
            self._pending = self._pending[length:]
