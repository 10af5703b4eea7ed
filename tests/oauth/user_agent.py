#!/usr/bin/env python3
"""Headless "browser" for the OAuth fixture (stdlib only).

Given an authorization URL it GETs it and follows redirects by hand, keeping cookies, through the
authorization server's /auth -> /interaction/<uid> -> /auth/<uid> ... chain, and stops at the first
redirect whose target starts with REDIRECT_PREFIX (the client's redirect URI). It never follows a
redirect into the client on its own.

Output (stdout):
  line 1: the callback URL exactly as the AS sent it (with code, state, iss - or error, ...)
  line 2 (--deliver only): the HTTP status the callback answered, e.g. 200
With --deliver the callback URL is fetched once (GET, same cookie jar, redirects not followed), as
a browser would after the AS redirected it there: use it when a real client (the Iteron CLI) is
listening on the loopback callback.

Exit status: 0 when the callback was reached (and, with --deliver, answered with any HTTP status);
1 when the chain failed (a non-redirect answer, too many redirects, timeout, connection error);
2 on usage errors. Diagnostics go to stderr.

Bounded: at most --max-redirects redirects (default 10) and --timeout seconds in total (default
10) including the delivery. Only http and https URLs are fetched; environment proxies are ignored.

  python3 user_agent.py [--deliver] [--max-redirects N] [--timeout S] AUTH_URL REDIRECT_PREFIX
"""

import argparse
import http.cookiejar
import sys
import time
import urllib.error
import urllib.parse
import urllib.request


class UserAgentError(Exception):
    """The authorization chain did not reach the callback."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401 - urllib hook
        return None


def _opener(jar):
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPCookieProcessor(jar),
        _NoRedirect(),
    )


def _get(opener, url, deadline):
    """GET url once; return (status, headers, body prefix). Redirects are returned, not followed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise UserAgentError("deadline exceeded")
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise UserAgentError(f"refusing to fetch a {scheme or 'relative'} URL: {url}")
    req = urllib.request.Request(url, method="GET", headers={"User-Agent": "iteron-oauth-fixture-ua/1"})
    try:
        with opener.open(req, timeout=remaining) as resp:
            return resp.status, resp.headers, resp.read(4096)
    except urllib.error.HTTPError as err:
        try:
            body = err.read(4096)
        except OSError:
            body = b""
        return err.code, err.headers, body
    except (urllib.error.URLError, OSError) as err:
        raise UserAgentError(f"GET {url}: {err}") from err


def authorize(auth_url, redirect_prefix, deliver=False, max_redirects=10, timeout=10.0, jar=None):
    """Drive the login. Returns (callback_url, delivery_status or None); raises UserAgentError."""
    deadline = time.monotonic() + timeout
    jar = jar if jar is not None else http.cookiejar.CookieJar()
    opener = _opener(jar)
    url = auth_url
    redirects = 0
    while True:
        status, headers, body = _get(opener, url, deadline)
        location = headers.get("Location") if 300 <= status < 400 else None
        if location is None:
            excerpt = body.decode("utf-8", "replace").strip().replace("\n", " ")[:500]
            raise UserAgentError(f"GET {url} answered {status} without a redirect: {excerpt}")
        redirects += 1
        if redirects > max_redirects:
            raise UserAgentError(f"more than {max_redirects} redirects")
        target = urllib.parse.urljoin(url, location)
        if target.startswith(redirect_prefix):
            if not deliver:
                return target, None
            delivered, _, _ = _get(opener, target, deadline)
            return target, delivered
        url = target


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("auth_url")
    parser.add_argument("redirect_prefix")
    parser.add_argument("--deliver", action="store_true", help="GET the callback URL and print its status")
    parser.add_argument("--max-redirects", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=10.0, help="total seconds")
    args = parser.parse_args(argv)
    if args.max_redirects < 1 or args.timeout <= 0:
        parser.error("--max-redirects and --timeout must be positive")
    try:
        callback, delivered = authorize(
            args.auth_url, args.redirect_prefix, args.deliver, args.max_redirects, args.timeout
        )
    except UserAgentError as err:
        print(f"user_agent: {err}", file=sys.stderr)
        return 1
    print(callback)
    if args.deliver:
        print(delivered)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
