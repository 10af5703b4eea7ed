#!/usr/bin/env python3
"""The OAuth fixture's own end-to-end test (stdlib only; no Rust, no Iteron).

Starts mcp_server.mjs and as.mjs with the documented startup protocol and walks a whole login the
way an MCP client must: 401 challenge -> protected-resource metadata -> AS metadata -> DCR of a
native public client -> authorization with PKCE S256, state and resource (user_agent.py, delivered
to a real loopback callback on another port than the registered one) -> code exchange with
resource -> MCP initialize + tools/call whoami with the bearer -> refresh with rotation -> the
rotated refresh token refused -> revocation -> introspection inactive -> the MCP server answers
401. Then the pre-registered confidential client path, including refresh-token reuse detection.
Negative checks along the way prove the AS is strict (no PKCE, wrong resource, missing resource on
/auth, /token and refresh, wrong client secret).

The walk runs once per access-token format: `jwt` (the default of as.mjs; the MCP server
verifies JWTs locally, so a revoked grant's access token is refused only once it expires) and
`opaque` (the MCP server introspects, so revocation shows on the next request).

  python3 tests/oauth/selftest.py [--mode jwt|opaque|both] [--keep] [--quiet]

Exit 0 when every step behaved as described; 1 on the first failure (with the servers' stderr);
2 when the fixture is not installed (run tests/oauth/setup).
"""

import argparse
import base64
import hashlib
import http.server
import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import user_agent  # noqa: E402  (same directory)

ACCOUNT = "iteron-test-user"
SCOPE = "mcp:tools"


class Failure(Exception):
    pass


QUIET = False


def ok(message):
    if not QUIET:
        print(f"  ok  {message}", flush=True)


def check(condition, message, detail=None):
    if not condition:
        raise Failure(message if detail is None else f"{message}: {detail}")
    ok(message)


# --- HTTP ------------------------------------------------------------------------------------------

class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class Response:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        try:
            return json.loads(self.body or b"null")
        except ValueError as err:
            raise Failure(f"not JSON ({err}): {self.body[:300]!r}") from err

    def __repr__(self):
        return f"HTTP {self.status} {self.body[:300]!r}"


def request(method, url, *, headers=None, form=None, body_json=None, basic=None, timeout=10):
    data = None
    hdrs = dict(headers or {})
    if form is not None:
        data = urllib.parse.urlencode(form).encode()
        hdrs["Content-Type"] = "application/x-www-form-urlencoded"
    elif body_json is not None:
        data = json.dumps(body_json).encode()
        hdrs["Content-Type"] = "application/json"
    if basic is not None:
        enc = lambda s: urllib.parse.quote(s, safe="").replace("%20", "+")  # RFC 6749 2.3.1
        token = base64.b64encode(f"{enc(basic[0])}:{enc(basic[1])}".encode()).decode()
        hdrs["Authorization"] = f"Basic {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return Response(resp.status, resp.headers, resp.read())
    except urllib.error.HTTPError as err:
        return Response(err.code, err.headers, err.read())


def parse_challenge(value):
    """Parse `Bearer k="v", k2="v2"` into (scheme, {k: v})."""
    scheme, _, rest = (value or "").partition(" ")
    params = {}
    i = 0
    while i < len(rest):
        while i < len(rest) and rest[i] in " ,":
            i += 1
        eq = rest.find("=", i)
        if eq < 0:
            break
        key = rest[i:eq].strip()
        i = eq + 1
        if i < len(rest) and rest[i] == '"':
            end = rest.find('"', i + 1)
            params[key] = rest[i + 1:end]
            i = end + 1
        else:
            end = rest.find(",", i)
            end = len(rest) if end < 0 else end
            params[key] = rest[i:end].strip()
            i = end
    return scheme, params


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt_parts(token):
    def dec(seg):
        return json.loads(base64.urlsafe_b64decode(seg + "=" * (-len(seg) % 4)))
    head, payload, _ = token.split(".")
    return dec(head), dec(payload)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- processes -------------------------------------------------------------------------------------

class Node:
    """A node child with its stdout read line by line on a thread and stderr kept in a file."""

    def __init__(self, name, script, env, workdir, stdin=False):
        self.name = name
        self.errpath = os.path.join(workdir, f"{name}.stderr")
        self._err = open(self.errpath, "wb")
        node = os.environ.get("NODE", "node")
        self.proc = subprocess.Popen(
            [node, os.path.join(HERE, script)],
            cwd=HERE,
            env={**os.environ, **env},
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._err,
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for raw in self.proc.stdout:
            self.lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise Failure(f"{self.name}: no '{prefix}' line within {timeout}s") from None
            if line is None:
                raise Failure(f"{self.name}: exited ({self.proc.wait()}) before printing '{prefix}'")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def send(self, line):
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin:
            self.proc.stdin.close()
        self._err.close()

    def stderr_tail(self, n=30):
        try:
            with open(self.errpath, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class Callback:
    """A one-shot loopback redirect receiver, standing in for the Iteron CLI's callback."""

    def __init__(self):
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                received.append(self.path)
                body = b"login complete\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.handle_request, daemon=True)
        self.thread.start()

    def close(self):
        self.server.server_close()


# --- the walk --------------------------------------------------------------------------------------

class Walk:
    def __init__(self, mode, workdir):
        self.mode = mode
        self.workdir = workdir
        self.log = os.path.join(workdir, f"requests-{mode}.jsonl")
        self.access_ttl = 5 if mode == "jwt" else 60
        self.pre_id = "iteron-pre-registered"
        self.pre_secret = secrets.token_urlsafe(24)
        self.pre_method = "client_secret_basic" if mode == "jwt" else "client_secret_post"
        self.secrets_seen = [self.pre_secret]
        self.procs = []

    # helpers
    def mcp_call(self, token, method, params=None, rpc_id=1, notification=False):
        body = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            body["params"] = params
        if not notification:
            body["id"] = rpc_id
        headers = {"Accept": "application/json, text/event-stream"}
        if method != "initialize":
            headers["MCP-Protocol-Version"] = "2025-11-25"
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return request("POST", self.resource, headers=headers, body_json=body)

    def token(self, form, client=None):
        """POST /token as the DCR public client (client=None) or the pre-registered client."""
        form = dict(form)
        basic = None
        if client == "pre":
            if self.pre_method == "client_secret_basic":
                basic = (self.pre_id, self.pre_secret)
            else:
                form.update(client_id=self.pre_id, client_secret=self.pre_secret)
        else:
            form["client_id"] = self.client_id
        return request("POST", self.meta["token_endpoint"], form=form, basic=basic)

    def introspect(self, token, hint=None):
        form = {"token": token}
        if hint:
            form["token_type_hint"] = hint
        # The RS client (RS_CLIENT_ID/RS_CLIENT_SECRET defaults) may introspect any token.
        resp = request("POST", self.meta["introspection_endpoint"], form=form,
                       basic=("iteron-test-rs", "iteron-test-rs-secret"))
        return resp

    def auth_url(self, client_id, redirect_uri, verifier=None, state=None, **overrides):
        params = {
            "response_type": "code",
            "client_id": client_id,
            "redirect_uri": redirect_uri,
            "scope": SCOPE,
            "state": state or secrets.token_urlsafe(16),
            "resource": self.resource,
        }
        if verifier is not None:
            params["code_challenge"] = b64url(hashlib.sha256(verifier.encode()).digest())
            params["code_challenge_method"] = "S256"
        params.update(overrides)
        params = {k: v for k, v in params.items() if v is not None}
        return f"{self.meta['authorization_endpoint']}?{urllib.parse.urlencode(params)}"

    def login_expect_error(self, url, redirect_uri, error, what):
        callback, _ = user_agent.authorize(url, redirect_uri)
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(callback).query)
        check(q.get("error") == [error] and "code" not in q,
              f"{what} -> redirected back with error={error}", callback)
        check(q.get("iss") == [self.issuer], f"{what}: error response carries iss", callback)

    # steps
    def start(self):
        self.mcp = Node(f"mcp-{self.mode}", "mcp_server.mjs",
                        {"PORT": "0", "REQUEST_LOG": self.log}, self.workdir, stdin=True)
        self.procs.append(self.mcp)
        mcp_port = int(self.mcp.expect("LISTENING "))
        self.resource = f"http://127.0.0.1:{mcp_port}/mcp"
        self.asp = Node(f"as-{self.mode}", "as.mjs", {
            "PORT": "0",
            "MCP_RESOURCE": self.resource,
            "ACCESS_TTL": str(self.access_ttl),
            "ACCESS_TOKEN_FORMAT": self.mode,
            "PRE_CLIENT_ID": self.pre_id,
            "PRE_CLIENT_SECRET": self.pre_secret,
            "PRE_CLIENT_AUTH_METHOD": self.pre_method,
            "REQUEST_LOG": self.log,
        }, self.workdir)
        self.procs.append(self.asp)
        as_port = int(self.asp.expect("LISTENING "))
        self.issuer = f"http://127.0.0.1:{as_port}"
        self.mcp.send(self.issuer)
        check(self.mcp.expect("AS_ISSUER ") == self.issuer, f"pair up: MCP {self.resource}, AS {self.issuer}")

    def discovery(self):
        resp = self.mcp_call(None, "initialize", {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "iteron-oauth-selftest", "version": "0"}})
        check(resp.status == 401, "initialize without a bearer -> 401", resp)
        scheme, params = parse_challenge(resp.headers.get("WWW-Authenticate"))
        prm_url = f"{self.resource.rsplit('/mcp', 1)[0]}/.well-known/oauth-protected-resource/mcp"
        check(scheme == "Bearer" and params.get("resource_metadata") == prm_url and params.get("scope") == SCOPE
              and "error" not in params, "WWW-Authenticate: Bearer resource_metadata=<PRM>, scope=mcp:tools",
              resp.headers.get("WWW-Authenticate"))
        resp = self.mcp_call("not-a-valid-token", "tools/list")
        _, params = parse_challenge(resp.headers.get("WWW-Authenticate"))
        check(resp.status == 401 and params.get("error") == "invalid_token", "a junk bearer -> 401 invalid_token", resp)

        prm = request("GET", params["resource_metadata"]).json()
        check(prm == {"resource": self.resource, "authorization_servers": [self.issuer], "scopes_supported": [SCOPE]},
              "PRM document", prm)

        meta = request("GET", f"{self.issuer}/.well-known/oauth-authorization-server")
        check(meta.status == 200, "AS metadata at /.well-known/oauth-authorization-server", meta)
        self.meta = meta.json()
        m = self.meta
        check(m["issuer"] == self.issuer, "metadata issuer equals the issuer exactly", m["issuer"])
        check(m.get("code_challenge_methods_supported") == ["S256"], "code_challenge_methods_supported == [S256]")
        check(m.get("authorization_response_iss_parameter_supported") is True, "authorization_response_iss_parameter_supported")
        for key in ("authorization_endpoint", "token_endpoint", "registration_endpoint",
                    "revocation_endpoint", "introspection_endpoint", "jwks_uri"):
            check(m.get(key, "").startswith(self.issuer + "/"), f"{key} published under the issuer", m.get(key))
        oidc = request("GET", f"{self.issuer}/.well-known/openid-configuration").json()
        check(oidc == m, "OpenID discovery document is identical")

    def register(self):
        self.registered_port = free_port()
        resp = request("POST", self.meta["registration_endpoint"], body_json={
            "client_name": "iteron-oauth-selftest",
            "application_type": "native",
            "token_endpoint_auth_method": "none",
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "redirect_uris": [f"http://127.0.0.1:{self.registered_port}/callback"],
        })
        check(resp.status == 201, "DCR of a native public client -> 201", resp)
        body = resp.json()
        self.client_id = body["client_id"]
        check("client_secret" not in body and body.get("token_endpoint_auth_method") == "none",
              "no client_secret for token_endpoint_auth_method none", body)

    def negative_authorizations(self):
        cb = f"http://127.0.0.1:{free_port()}/callback"
        v = secrets.token_urlsafe(32)
        self.login_expect_error(self.auth_url(self.client_id, cb), cb, "invalid_request", "no PKCE challenge")
        self.login_expect_error(self.auth_url(self.client_id, cb, v, code_challenge_method="plain",
                                              code_challenge=v), cb, "invalid_request", "PKCE plain")
        self.login_expect_error(self.auth_url(self.client_id, cb, v, resource="http://127.0.0.1:1/other"),
                                cb, "invalid_target", "another resource")
        self.login_expect_error(self.auth_url(self.client_id, cb, v, resource=None), cb, "invalid_target",
                                "no resource (REQUIRE_RESOURCE)")

    def web_client_exact_redirect(self):
        registered = f"http://127.0.0.1:{free_port()}/callback"
        resp = request("POST", self.meta["registration_endpoint"], body_json={
            "token_endpoint_auth_method": "none", "grant_types": ["authorization_code"],
            "response_types": ["code"], "redirect_uris": [registered]})
        check(resp.status == 201 and resp.json().get("application_type") == "web", "DCR without application_type -> web", resp)
        other = f"http://127.0.0.1:{free_port()}/callback"
        url = self.auth_url(resp.json()["client_id"], other, secrets.token_urlsafe(32))
        try:
            user_agent.authorize(url, other)
            refused = None
        except user_agent.UserAgentError as err:
            refused = str(err)
        check(refused is not None and "redirect_uri" in refused,
              "a web client gets no loopback port flexibility: another port is refused (no redirect)", refused)

    def login_dcr(self):
        listener = Callback()
        try:
            redirect_uri = f"http://127.0.0.1:{listener.port}/callback"
            check(listener.port != self.registered_port, "callback port differs from the registered one (RFC 8252 7.3)")
            verifier = secrets.token_urlsafe(48)
            state = secrets.token_urlsafe(16)
            url = self.auth_url(self.client_id, redirect_uri, verifier, state)
            t0 = time.monotonic()
            # The command line a Rust test uses: stdout = callback URL, then the callback's status.
            run = subprocess.run([sys.executable, os.path.join(HERE, "user_agent.py"), "--deliver", url, redirect_uri],
                                 capture_output=True, text=True, timeout=30)
            out = run.stdout.splitlines()
            listener.thread.join(5)
            check(run.returncode == 0 and len(out) == 2 and out[1] == "200" and listener.received,
                  f"user_agent.py --deliver reached the callback ({time.monotonic() - t0:.2f}s)",
                  (run.returncode, run.stdout, run.stderr, listener.received))
            callback = out[0]
        finally:
            listener.close()
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(callback).query)
        check(urllib.parse.urlsplit(callback).path == "/callback"
              and listener.received[0] == urllib.parse.urlsplit(callback)._replace(scheme="", netloc="").geturl(),
              "the listener got exactly the callback URL", listener.received)
        check(q.get("state") == [state] and q.get("iss") == [self.issuer] and len(q.get("code", [])) == 1,
              "callback has code, the same state and iss == issuer", q.keys())
        code = q["code"][0]
        self.secrets_seen.append(code)

        resp = self.token({"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                           "code_verifier": verifier})
        check(resp.status == 400 and resp.json().get("error") == "invalid_target",
              "code exchange without resource -> 400 invalid_target", resp)
        resp = self.token({"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                           "code_verifier": verifier, "resource": self.resource})
        check(resp.status == 200, "code exchange with resource -> 200 (the refused attempt consumed nothing)", resp)
        tok = resp.json()
        self.secrets_seen += [tok["access_token"], tok["refresh_token"], verifier]
        check(tok.get("token_type") == "Bearer" and tok.get("scope") == SCOPE and tok.get("expires_in") == self.access_ttl
              and tok.get("refresh_token") and "id_token" not in tok,
              "tokens: Bearer, scope mcp:tools, expires_in = ACCESS_TTL, a refresh token without offline_access",
              {k: v for k, v in tok.items() if k not in ("access_token", "refresh_token")})
        self.check_access_token(tok["access_token"], self.client_id)
        self.at, self.rt = tok["access_token"], tok["refresh_token"]

    def check_access_token(self, at, client_id):
        if self.mode == "jwt":
            head, claims = jwt_parts(at)
            check(head.get("typ") == "at+jwt" and head.get("alg") == "RS256", "JWT access token (typ at+jwt, RS256)", head)
            check(claims.get("aud") == self.resource and claims.get("iss") == self.issuer
                  and claims.get("sub") == ACCOUNT and claims.get("client_id") == client_id and claims.get("scope") == SCOPE,
                  "JWT claims: aud = the MCP resource, iss, sub, client_id, scope", claims)
            resp = self.introspect(at)
            check(resp.status == 400 and resp.json().get("error") == "unsupported_token_type",
                  "a JWT access token cannot be introspected (oidc-provider: unsupported_token_type)", resp)
        else:
            check(at.count(".") == 0, "opaque access token")
            info = self.introspect(at).json()
            check(info.get("active") is True and info.get("aud") == self.resource and info.get("iss") == self.issuer
                  and info.get("sub") == ACCOUNT and info.get("client_id") == client_id and info.get("scope") == SCOPE
                  and info.get("token_type") == "Bearer",
                  "introspection: active, aud = the MCP resource, iss, sub, client_id, scope", info)

    def whoami(self, at, client_id):
        resp = self.mcp_call(at, "initialize", {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "iteron-oauth-selftest", "version": "0"}})
        check(resp.status == 200 and resp.json().get("result", {}).get("protocolVersion") == "2025-11-25",
              "initialize with the bearer -> 200", resp)
        resp = self.mcp_call(at, "notifications/initialized", notification=True)
        check(resp.status == 202, "notifications/initialized -> 202", resp)
        resp = self.mcp_call(at, "tools/list", rpc_id=2)
        names = [t["name"] for t in resp.json().get("result", {}).get("tools", [])]
        check(resp.status == 200 and names == ["whoami"], "tools/list -> [whoami]", resp)
        resp = self.mcp_call(at, "tools/call", {"name": "whoami", "arguments": {}}, rpc_id=3)
        result = resp.json().get("result", {})
        who = json.loads(result["content"][0]["text"]) if result.get("content") else None
        validated = "jwt" if self.mode == "jwt" else "introspection"
        check(resp.status == 200 and who == {"sub": ACCOUNT, "scope": SCOPE, "client_id": client_id,
                                             "aud": self.resource, "validated_by": validated},
              f"tools/call whoami -> sub {ACCOUNT}, scope {SCOPE}, validated by {validated}", resp)

    def refresh_and_revoke(self):
        active = lambda tok, hint=None: self.introspect(tok, hint).json().get("active")  # noqa: E731
        check(active(self.rt, "refresh_token") is True, "introspection: the refresh token is active")
        resp = self.token({"grant_type": "refresh_token", "refresh_token": self.rt})
        check(resp.status == 400 and resp.json().get("error") == "invalid_target",
              "refresh without resource -> 400 invalid_target", resp)
        check(active(self.rt, "refresh_token") is True, "... and the refresh token was not consumed")
        resp = self.token({"grant_type": "refresh_token", "refresh_token": self.rt, "resource": self.resource})
        check(resp.status == 200, "refresh with resource -> 200", resp)
        tok = resp.json()
        self.secrets_seen += [tok["access_token"], tok["refresh_token"]]
        check(tok["refresh_token"] != self.rt and tok["access_token"] != self.at and tok.get("scope") == SCOPE,
              "refresh rotated the refresh token and issued a new access token for mcp:tools")
        self.check_access_token(tok["access_token"], self.client_id)
        old_rt, self.rt, self.at = self.rt, tok["refresh_token"], tok["access_token"]
        check(active(old_rt, "refresh_token") is False and active(self.rt, "refresh_token") is True,
              "introspection: the old refresh token is inactive, the new one active (no side effects)")
        resp = self.mcp_call(self.at, "tools/call", {"name": "whoami", "arguments": {}}, rpc_id=4)
        check(resp.status == 200, "whoami with the refreshed access token -> 200", resp)

        resp = request("POST", self.meta["revocation_endpoint"],
                       form={"token": self.rt, "token_type_hint": "refresh_token", "client_id": self.client_id})
        check(resp.status == 200, "RFC 7009 revocation of the refresh token (public client) -> 200", resp)
        check(active(self.rt, "refresh_token") is False, "introspection: the revoked refresh token is inactive")
        if self.mode == "opaque":
            check(active(self.at) is False, "introspection: the grant's access token is inactive too")
            resp = self.mcp_call(self.at, "tools/call", {"name": "whoami", "arguments": {}}, rpc_id=5)
            _, params = parse_challenge(resp.headers.get("WWW-Authenticate"))
            check(resp.status == 401 and params.get("error") == "invalid_token",
                  "the MCP server refuses the revoked grant's access token at once -> 401", resp)
        else:
            resp = self.mcp_call(self.at, "tools/call", {"name": "whoami", "arguments": {}}, rpc_id=5)
            check(resp.status == 200, "a JWT access token outlives the revocation until it expires (stateless)", resp)
            exp = jwt_parts(self.at)[1]["exp"]
            time.sleep(max(0.0, exp - time.time()) + 1.1)
            resp = self.mcp_call(self.at, "tools/call", {"name": "whoami", "arguments": {}}, rpc_id=5)
            _, params = parse_challenge(resp.headers.get("WWW-Authenticate"))
            check(resp.status == 401 and params.get("error") == "invalid_token",
                  f"after exp (ACCESS_TTL={self.access_ttl}s) the MCP server answers 401 invalid_token", resp)
        for what, rt in (("the rotated (old)", old_rt), ("the revoked", self.rt)):
            resp = self.token({"grant_type": "refresh_token", "refresh_token": rt, "resource": self.resource})
            check(resp.status == 400 and resp.json().get("error") == "invalid_grant",
                  f"{what} refresh token -> 400 invalid_grant", resp)

    def pre_registered(self):
        redirect_uri = f"http://127.0.0.1:{free_port()}/callback"
        verifier = secrets.token_urlsafe(48)
        state = secrets.token_urlsafe(16)
        callback, delivered = user_agent.authorize(self.auth_url(self.pre_id, redirect_uri, verifier, state), redirect_uri)
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(callback).query)
        check(delivered is None and q.get("state") == [state] and q.get("iss") == [self.issuer] and "code" in q,
              f"pre-registered client ({self.pre_method}): login on an arbitrary loopback port, URL printed not fetched",
              callback)
        code = q["code"][0]
        self.secrets_seen.append(code)
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                "code_verifier": verifier, "resource": self.resource}
        good, self.pre_secret = self.pre_secret, "wrong-secret"
        resp = self.token(form, client="pre")
        self.pre_secret = good
        check(resp.status == 401 and resp.json().get("error") == "invalid_client", "wrong client secret -> 401 invalid_client", resp)
        resp = self.token(form, client="pre")
        check(resp.status == 200, f"code exchange with {self.pre_method} -> 200", resp)
        tok = resp.json()
        self.secrets_seen += [tok["access_token"], tok["refresh_token"]]
        self.check_access_token(tok["access_token"], self.pre_id)
        resp = self.mcp_call(tok["access_token"], "tools/call", {"name": "whoami", "arguments": {}}, rpc_id=6)
        who = json.loads(resp.json()["result"]["content"][0]["text"])
        check(resp.status == 200 and who["client_id"] == self.pre_id, "whoami shows the pre-registered client", who)

        resp = self.token({"grant_type": "refresh_token", "refresh_token": tok["refresh_token"],
                           "resource": self.resource}, client="pre")
        check(resp.status == 200, "confidential client refresh -> 200 (rotated: rotateRefreshToken = true)", resp)
        new = resp.json()
        self.secrets_seen += [new["access_token"], new["refresh_token"]]
        check(new["refresh_token"] != tok["refresh_token"], "the confidential client's refresh token rotated too")
        resp = self.token({"grant_type": "refresh_token", "refresh_token": tok["refresh_token"],
                           "resource": self.resource}, client="pre")
        check(resp.status == 400 and resp.json().get("error") == "invalid_grant",
              "presenting the rotated refresh token again -> invalid_grant", resp)
        info = self.introspect(new["refresh_token"], "refresh_token").json()
        check(info.get("active") is False,
              "... and that reuse revoked the whole grant: the newest refresh token is inactive too", info)

    def log_hygiene(self):
        with open(self.log, encoding="utf-8") as f:
            text = f.read()
        entries = [json.loads(line) for line in text.splitlines()]
        routes = {e.get("route") for e in entries if e.get("who") == "as"}
        check({"authorization", "token", "registration", "revocation", "introspection"} <= routes
              and any(e.get("who") == "mcp" for e in entries), f"REQUEST_LOG has {len(entries)} entries from both servers")
        leaked = [s for s in self.secrets_seen if s and s in text]
        check(not leaked, "REQUEST_LOG holds no token, code, verifier or secret value")

    def run(self):
        print(f"[{self.mode}] access tokens: {self.mode}", flush=True)
        t0 = time.monotonic()
        try:
            self.start()
            self.discovery()
            self.register()
            self.negative_authorizations()
            self.web_client_exact_redirect()
            self.login_dcr()
            self.whoami(self.at, self.client_id)
            self.refresh_and_revoke()
            self.pre_registered()
            self.log_hygiene()
        except Exception:
            for p in self.procs:
                tail = p.stderr_tail()
                if tail:
                    print(f"--- {p.name} stderr (last lines) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            for p in self.procs:
                p.stop()
        print(f"[{self.mode}] passed in {time.monotonic() - t0:.1f}s", flush=True)


def main(argv=None):
    global QUIET
    parser = argparse.ArgumentParser(description="OAuth fixture self-test")
    parser.add_argument("--mode", choices=["jwt", "opaque", "both"], default="both")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, stderr)")
    parser.add_argument("--quiet", action="store_true", help="print only the per-mode summary")
    args = parser.parse_args(argv)
    QUIET = args.quiet
    for dep in ("oidc-provider", "@modelcontextprotocol/sdk", "jose"):
        if not os.path.isdir(os.path.join(HERE, "node_modules", dep)):
            print(f"selftest: node_modules/{dep} missing; run tests/oauth/setup", file=sys.stderr)
            return 2
    workdir = tempfile.mkdtemp(prefix="iteron-oauth-selftest-")
    modes = ["jwt", "opaque"] if args.mode == "both" else [args.mode]
    t0 = time.monotonic()
    try:
        for mode in modes:
            Walk(mode, workdir).run()
    except (Failure, user_agent.UserAgentError) as err:
        print(f"selftest: FAILED: {err}", file=sys.stderr)
        print(f"selftest: logs kept in {workdir}", file=sys.stderr)
        return 1
    if args.keep:
        print(f"selftest: logs in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"selftest: all passed in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
