"""Who may talk to `lollm serve` (issue 42): the API key, the Host, the Origin, CORS, JSON bodies; 400s name the field.

The server runs in this process on the toy family (as in test_server_hostile.py), wrapped in
:class:`lollm.serve.guard.Guard` as ``lollm serve`` wraps it, through Starlette's TestClient
(the Host a request carries is the TestClient's base URL). What each test proves:

* the key: only ``Authorization: Bearer KEY``, the scheme in any case (RFC 7235), compared with
  ``hmac.compare_digest``; every refusal a 401 with ``WWW-Authenticate: Bearer`` (RFC 6750);
  ``--api-key-file`` reads it from a file, and a bad file is one error line before torch loads;
* a POST body must be ``application/json`` (415): a page's "simple" ``text/plain`` POST is refused;
* the Host must name this server (403 otherwise; ``--allowed-host`` adds names): DNS rebinding;
* cross-origin requests are refused unless ``--cors-origin`` lists the origin, and then the preflight
  and the answers carry the CORS headers a browser checks; the chat page (same origin) works in a
  real Chromium through the guard;
* a 400 names the request's field (``param: "temperature"``), not a command-line flag;
* every route is described in /openapi.json (so the fuzz sessions, built from it, reach it).
"""

from __future__ import annotations

import hmac

import pytest

import lollm.serve.guard as guard_module
from lollm.errors import LollmError
from lollm.serve.app import create_app
from lollm.serve.guard import Guard, GuardConfig, read_api_key_file
from lollm.serve.model_server import ModelServer

from test_cli_run import probe, toy_site, ckpt  # noqa: F401  (fixtures: the toy family and checkpoint)
from test_server_hostile import NAME, loaded  # noqa: F401  (the toy checkpoint, loaded once per module)

KEY = "sk-test-0123456789"
LOCAL = "http://127.0.0.1:8000"
HELLO = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(loaded):  # noqa: F811
    return ModelServer(loaded, name=NAME, context=64, api_key=KEY)


def client_of(server: ModelServer, config: GuardConfig = GuardConfig(), base_url: str = LOCAL):
    from starlette.testclient import TestClient

    return TestClient(Guard(create_app(server), config), base_url=base_url, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(server):
    with client_of(server) as test_client:
        yield test_client


def refused(response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


# -- the API key -------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"  Bearer   {KEY} "])
def test_the_key_is_accepted_as_a_bearer_token_in_any_case(client, header):
    assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize("header", [None, KEY, f"Basic {KEY}", f"Token {KEY}", "Bearer sk-wrong", "Bearer", "Bearer ",
                                    f"Bearer {KEY}x", f"Bearer{KEY}"])
def test_anything_else_is_a_401_with_www_authenticate(client, header):
    headers = {} if header is None else {"Authorization": header}
    for response in (client.get("/v1/models", headers=headers), client.post("/v1/chat/completions", json=HELLO, headers=headers)):
        refused(response, 401, "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"


def test_keys_are_compared_in_constant_time(client, monkeypatch):
    seen, compare = [], hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(guard_module.hmac, "compare_digest", spy)
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-guess"}).status_code == 401
    assert seen == [(b"sk-guess", KEY.encode())]


def test_the_key_can_come_from_a_file(tmp_path, server):
    path = tmp_path / "key"
    path.write_text(f"{KEY}\n")
    assert read_api_key_file(path) == KEY
    for text, needle in (("", "is empty"), ("two words", "whitespace")):
        path.write_text(text)
        with pytest.raises(LollmError, match=needle):
            read_api_key_file(path)
    with pytest.raises(LollmError, match="cannot read it"):
        read_api_key_file(tmp_path / "missing")


@pytest.mark.parametrize("flags, needle", [
    (("--api-key-file", "/nonexistent/key"), "--api-key-file /nonexistent/key: cannot read it"),
    (("--api-key", "a", "--api-key-file", "/nonexistent/key"), "not both"),
    (("--shutdown-timeout", "-1"), "--shutdown-timeout must be"),
    (("--cors-origin", "*"), "--cors-origin '*'"),
    (("--cors-origin", "http://ui.example/path"), "no path"),
    (("--allowed-host", "http://x/"), "--allowed-host"),
])
def test_a_bad_access_flag_is_one_error_line_before_torch_loads(toy_site, ckpt, flags, needle):  # noqa: F811
    done = probe("serve", str(ckpt), "--port", "1", *flags, site=toy_site)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines == [lines[0], "torch not imported"] and needle in lines[0], done.stderr


# -- browsers: the body's type, the Host, the Origin ----------------------------------------------------

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_a_post_body_must_be_json(client, content_type):
    """A page may send these cross-origin without a preflight (a "simple request"): refused before any work."""
    import json

    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    response = client.post("/v1/chat/completions", content=json.dumps(HELLO).encode(), headers=headers)
    refused(response, 415, "unsupported_media_type")


def test_json_with_a_charset_is_json(client):
    import json

    response = client.post("/v1/chat/completions", content=json.dumps(HELLO).encode(),
                           headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("host", ["evil.example:8000", "evil.example", "127.0.0.1.evil.example", "localhost.evil.example",
                                  "192.168.1.20:8000"])
def test_a_foreign_host_is_a_403(client, host):
    """A DNS-rebinding page reaches 127.0.0.1 under its own name; its requests carry that name."""
    error = refused(client.get("/v1/models", headers={**AUTH, "Host": host}), 403, "host_not_allowed")
    assert "--allowed-host" in error["message"]
    refused(client.post("/v1/chat/completions", json=HELLO, headers={**AUTH, "Host": host}), 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "app.localhost:8000",
                                  "127.0.0.2"])
def test_localhost_names_and_loopback_addresses_are_this_server(client, host):
    assert client.get("/v1/models", headers={**AUTH, "Host": host}).status_code == 200


def test_allowed_host_and_the_bound_address(server):
    with client_of(server, GuardConfig(allowed_hosts=("box.lan",))) as named:
        assert named.get("/v1/models", headers={**AUTH, "Host": "box.lan:8000"}).status_code == 200
        assert named.get("/v1/models", headers={**AUTH, "Host": "other.lan:8000"}).status_code == 403
    with client_of(server, GuardConfig(bound="10.1.2.3")) as bound:
        assert bound.get("/v1/models", headers={**AUTH, "Host": "10.1.2.3:8000"}).status_code == 200
        assert bound.get("/v1/models", headers={**AUTH, "Host": "10.1.2.4:8000"}).status_code == 403
    with client_of(server, GuardConfig(bound="0.0.0.0")) as everywhere:  # any address: an IP cannot be rebound
        assert everywhere.get("/v1/models", headers={**AUTH, "Host": "10.1.2.4:8000"}).status_code == 200
        assert everywhere.get("/v1/models", headers={**AUTH, "Host": "evil.example:8000"}).status_code == 403
    with client_of(server, GuardConfig(allowed_hosts=("*",))) as anyone:
        assert anyone.get("/v1/models", headers={**AUTH, "Host": "evil.example"}).status_code == 200


def test_cross_origin_requests_are_refused_by_default(client):
    """The issue's CSRF: a text/plain POST from another origin, and a preflight: both 403 (no CORS header)."""
    evil = {"Origin": "http://evil.example"}
    response = client.post("/v1/chat/completions", content=b"{}", headers={**evil, "Content-Type": "text/plain"})
    refused(response, 403, "origin_not_allowed")
    preflight = client.options("/v1/chat/completions", headers={**evil, "Access-Control-Request-Method": "POST",
                                                                 "Access-Control-Request-Headers": "content-type"})
    error = refused(preflight, 403, "origin_not_allowed")
    assert "--cors-origin http://evil.example" in error["message"]
    assert "access-control-allow-origin" not in preflight.headers
    get = client.get("/v1/models", headers={**AUTH, **evil})
    assert get.status_code == 403 and "access-control-allow-origin" not in get.headers


def test_a_listed_origin_gets_correct_cors_answers(server):
    ui = "http://ui.example:3000"
    with client_of(server, GuardConfig(cors_origins=(ui,))) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "Origin": ui, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == ui
        assert {"GET", "POST"} <= {m.strip() for m in preflight.headers["access-control-allow-methods"].split(",")}
        allowed = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-stainless-os"} <= allowed
        assert "Origin" in preflight.headers["vary"]
        answer = client.post("/v1/chat/completions", json=HELLO, headers={**AUTH, "Origin": ui})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ui
        assert "Retry-After" in answer.headers["access-control-expose-headers"]
        denied = client.post("/v1/chat/completions", json=HELLO, headers={"Origin": ui})  # the page can read its 401
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ui
        other = client.options("/v1/chat/completions", headers={"Origin": "http://ui.example:3001",
                                                                "Access-Control-Request-Method": "POST"})
        refused(other, 403, "origin_not_allowed")


def test_the_chat_page_is_same_origin(client):
    """The page's own requests carry Origin = http:// + Host: allowed with no flag."""
    assert client.get("/", headers={"Host": "127.0.0.1:8000"}).status_code == 200
    same = {**AUTH, "Origin": LOCAL, "Host": "127.0.0.1:8000"}
    assert client.post("/v1/chat/completions", json={**HELLO, "stream": True}, headers=same).status_code == 200


def test_the_chat_page_works_through_the_guard_in_a_browser(loaded):  # noqa: F811
    """The page in a real Chromium, served as `lollm serve` serves it (the Guard in front): it streams an answer."""
    from lollm.testing import serving
    from lollm.testing.browser import Browser

    from test_chat_page import _open, _say

    plain = ModelServer(loaded, name=NAME, context=64)
    with Browser() as browser, serving.app_in_thread(Guard(create_app(plain), GuardConfig())) as root:
        _open(browser, root + "/")
        browser.js("document.getElementById('max_tokens').value = '3'")
        _say(browser, "hello")
        assert browser.texts(".msg.error") == [] and browser.texts(".msg.assistant .stats")[-1].startswith("3 tokens")
        assert browser.errors() == []


# -- 400s name the request's field ------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("min_p", 2),
                                          ("repetition_penalty", 0), ("top_k", -5)])
def test_a_bad_sampling_value_names_the_field_not_a_flag(client, field, value):
    response = client.post("/v1/chat/completions", json={**HELLO, field: value}, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field!r}: "), error
    assert "--" not in error["message"], error


# -- every route is in /openapi.json --------------------------------------------------------------------------


def test_every_route_is_described_in_openapi(server, client):
    """The fuzz sessions (schemathesis, the hostile-body test) build their cases from /openapi.json: a route missing
    from it would go unfuzzed. Every route but the page and the schema itself is there, with the guard's answers."""
    from starlette.routing import Route

    schema = client.get("/openapi.json").json()
    routes = {(r.path, m.lower()) for r in create_app(server).routes if isinstance(r, Route)
              for m in r.methods if m not in ("HEAD", "OPTIONS")}
    described = {(path, method) for path, operations in schema["paths"].items() for method in operations}
    assert routes - {("/", "get"), ("/openapi.json", "get")} == described
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "403" in operation["responses"] and (method != "post" or "415" in operation["responses"]), path
