"""What ``lollm serve`` checks before a request reaches a route: the API key, the Host, the Origin, the body's type.

A server on 127.0.0.1 is reachable by more than the user's own programs: every web page the
user opens runs in a browser on the same machine. Three attacks follow, each closed here
(docs/security.md, "The server: browsers"):

* **Cross-site request forgery.** A page may POST to any address without asking first when the
  request is "simple" (a ``Content-Type`` of ``text/plain``, form data, or none). So a POST body
  must say ``Content-Type: application/json`` (else 415): a browser sends that type cross-origin
  only after a preflight (``OPTIONS``) the server answers, and the server refuses it.
* **DNS rebinding.** A page at ``http://evil.example:8000`` can make its own name resolve to
  127.0.0.1; the browser then takes the server for the page's own origin and lets the page read
  the answers. Its requests still say ``Host: evil.example:8000``. So the Host must name this
  server: a localhost name, an IP address (a rebinding page has a name, never an address), the
  machine's own name when the server listens on every interface, or a ``--allowed-host`` entry;
  anything else is a 403. ollama closed the same hole this way (CVE-2024-28224).
* **Reading across origins.** Cross-origin requests are refused unless their ``Origin`` is one of
  ``--cors-origin``: a request whose ``Origin`` is neither this server's own nor listed is a 403,
  and so is a preflight. Listed origins get CORS answers from Starlette's ``CORSMiddleware``.

The chat page at ``/`` is same-origin (its ``Origin`` equals ``http://`` + its Host), so it works
with none of the flags. Programs (curl, the ``openai`` package) send no ``Origin`` and a Host of
the address they dialled.

The API key (``--api-key`` or ``--api-key-file``): ``Authorization: Bearer KEY``, the scheme in
any case (RFC 7235: schemes are case-insensitive), the key compared in constant time
(``hmac.compare_digest``); anything else is a 401 with ``WWW-Authenticate: Bearer`` (RFC 6750).
:func:`check_authorization` does it; every route that needs it calls it (through
:meth:`lollm.serve.model_server.ModelServer.check_auth`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lollm.errors import LollmError

# Lazy import below: lollm.serve.requests (it imports torch) is imported where an ApiError is made, so the
# command line checks its flags with this module before anything heavy loads.

if TYPE_CHECKING:  # starlette is the optional ``serve`` extra: imported where it is used
    from starlette.types import ASGIApp, Receive, Scope, Send

#: Names that always mean this machine: RFC 6761 reserves ``localhost`` and every name under it.
LOCAL_NAMES = ("localhost",)
#: The methods a listed origin may use, and the headers the browser may read from an answer.
CORS_METHODS = ("GET", "POST")
CORS_EXPOSED = ("Retry-After",)


def check_authorization(header: str | None, key: str | None, *, x_api_key: bool = False) -> None:
    """Nothing when ``key`` is None or ``header`` is ``Bearer <key>`` (scheme in any case); else ApiError 401.

    header: the ``Authorization`` request header (None: absent); x_api_key: the endpoint also takes
    the key as ``x-api-key`` (Anthropic's clients), and the 401's message says so. The key is compared with
    ``hmac.compare_digest`` so the time taken does not tell how much of a guess was right.
    The 401 carries ``WWW-Authenticate: Bearer`` (RFC 6750, section 3).
    """
    from lollm.serve.requests import ApiError

    if key is None:
        return
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        missing = "missing" if not header else "incorrect"
        how = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if x_api_key else "'Authorization: Bearer <key>'"
        raise ApiError(401, f"{missing} API key: send the header {how} with the key given to "
                            f"lollm serve --api-key or --api-key-file", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def read_api_key_file(path: str | Path) -> str:
    """The API key in the file ``path``: its text without surrounding whitespace; LollmError naming the file.

    So a key need not sit in the process list (``ps`` shows ``--api-key KEY`` to every user).
    Refused: a missing or unreadable file, an empty one, a key with inner whitespace or
    control characters (it could never match a header).
    """
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise LollmError(f"--api-key-file {path}: cannot read it ({error})") from None
    if not key:
        raise LollmError(f"--api-key-file {path}: the file is empty; write the key in it")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in key):
        raise LollmError(f"--api-key-file {path}: the key holds whitespace or control characters (one line, one key)")
    return key


def host_name(host: str) -> str:
    """The name part of a Host header (``127.0.0.1:8000`` -> ``127.0.0.1``, ``[::1]:8000`` -> ``::1``), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class GuardConfig:
    """Who may talk to the server (``lollm serve`` flags).

    bound:         the address it listens on (``--host``): its own IP is allowed in a Host header;
                   ``0.0.0.0`` or ``::`` allow every IP and the machine's name.
    allowed_hosts: more Host names (``--allowed-host``, lower case; ``*`` turns the Host check off).
    cors_origins:  origins (``https://ui.example:3000``) allowed cross-origin (``--cors-origin``).
    """

    bound: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = field(default=())

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request's Host header names this server (None: no header, an HTTP/1.0 program: allowed)."""
        if host is None or "*" in self.allowed_hosts:
            return True
        name = host_name(host)
        if name in LOCAL_NAMES or name.endswith(".localhost") or name in self.allowed_hosts:
            return True
        everywhere = self.bound in ("0.0.0.0", "::", "")
        if is_ip(name):  # an address cannot be rebound; one of this server's, or any when it listens everywhere
            return everywhere or ipaddress.ip_address(name).is_loopback or name == host_name(self.bound)
        return everywhere and name == socket.gethostname().lower()


def check_cors_origin(origin: str) -> str:
    """One ``--cors-origin`` value, checked: ``scheme://host[:port]``, no path; LollmError naming the flag."""
    scheme, sep, rest = origin.partition("://")
    if origin == "*" or not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        raise LollmError(f"--cors-origin {origin!r}: give an origin as a browser sends it, scheme://host[:port] "
                         f"(http or https, no path, no '*'), e.g. http://localhost:3000")
    return origin.lower()


def _refusal(status: int, message: str, code: str, path: str = "") -> tuple[int, bytes]:
    """(status, JSON body) of a refusal: in Anthropic's error shape on ``/v1/messages``, OpenAI's elsewhere."""
    from lollm.serve.error_shapes import error_for_path
    from lollm.serve.requests import ApiError, log_refusal

    error = ApiError(status, message, code=code)
    log_refusal(path or "-", error)
    return status, json.dumps(error_for_path(error, path)).encode()


async def answer(send: Send, refusal: tuple[int, bytes]) -> None:
    """Send a refusal: (status, JSON body) as the whole answer."""
    status, body = refusal
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def header_dict(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (the last one of a name wins)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


class Guard:
    """ASGI middleware: the Host and the Origin (403), then CORS, then a POST's Content-Type (415).

    app:    the application (Starlette's, :func:`lollm.serve.app.create_app`).
    config: a :class:`GuardConfig`.

    The layers, outside in: this class's Host and Origin checks; Starlette's ``CORSMiddleware``
    when ``config.cors_origins`` lists any (it answers a listed origin's preflight and adds the
    ``Access-Control-*`` headers, to a 415 or a 401 too, so the page can read why); then
    :class:`JsonOnly`. Refusals carry an OpenAI-style JSON error body (Anthropic's on ``/v1/messages``).
    """

    def __init__(self, app: ASGIApp, config: GuardConfig):
        self.config = config
        self.app: ASGIApp = JsonOnly(app)
        if config.cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            self.app = CORSMiddleware(self.app, allow_origins=list(config.cors_origins), allow_methods=list(CORS_METHODS),
                                      allow_headers=["*"], expose_headers=list(CORS_EXPOSED))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = self.refusal(header_dict(scope), scope.get("path", "")) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await answer(send, refused)

    def refusal(self, headers: dict[str, str], path: str = "") -> tuple[int, bytes] | None:
        """(403, JSON body) for a foreign Host or a cross-origin request from an origin not listed; None: go on.

        ``path``: the request's path, which picks the error's shape (:func:`_refusal`)."""
        host, origin = headers.get("host"), headers.get("origin")
        if not self.config.host_allowed(host):
            return _refusal(403, f"the Host header {host[:100]!r} does not name this server (a DNS-rebinding page "
                                 f"would send such a name): use the address it listens on, or start it with "
                                 f"lollm serve --allowed-host {host_name(host)[:100]}", "host_not_allowed", path)
        if origin is None or origin.lower() in self.config.cors_origins:
            return None
        if host is not None and origin.lower() in (f"http://{host}".lower(), f"https://{host}".lower()):
            return None  # same-origin: the chat page
        return _refusal(403, f"cross-origin requests from {origin[:100]!r} are refused: start the server with "
                             f"lollm serve --cors-origin {origin[:100]} to allow that origin", "origin_not_allowed", path)


class JsonOnly:
    """ASGI middleware: a POST whose Content-Type is not ``application/json`` gets a 415 (no browser sends that
    type cross-origin without a preflight, so no page can forge a request: see the module's docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            given = header_dict(scope).get("content-type")
            if not is_json_type(given):
                got = f"got {given[:100]!r}" if given else "the request has none"
                await answer(send, _refusal(415, f"a POST body must be sent with 'Content-Type: application/json'; "
                                                 f"{got}", "unsupported_media_type", scope.get("path", "")))
                return
        await self.app(scope, receive, send)


def is_json_type(content_type: str | None) -> bool:
    """Whether a Content-Type header says JSON: ``application/json``, parameters (``; charset=utf-8``) allowed."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"
