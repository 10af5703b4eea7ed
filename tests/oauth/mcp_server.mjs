// A bearer-protected MCP server for Iteron's OAuth tests: TS SDK 1.32.2 McpServer over stateless
// Streamable HTTP (JSON responses) at http://127.0.0.1:<port>/mcp with one tool, `whoami`, that
// reports the subject, scope, client and audience of the access token used for the call.
//
// Run: node mcp_server.mjs   (configuration from the environment, see README.md)
// Prints "LISTENING <port>" on stdout once requests are served.
//
// The authorization server's issuer comes from AS_ISSUER or, when that is unset or to change it
// later (authorization-server migration tests), from stdin: every non-empty line is a new issuer,
// acknowledged with "AS_ISSUER <issuer>" on stdout. Requests that need the issuer before one is
// known wait for it (at most ISSUER_WAIT_MS, default 10000) and then get 503.
//
// Token validation, chosen per token:
//   - a JWS (oidc-provider's `at+jwt` access tokens): signature against the AS's JWKS (jose),
//     `typ` at+jwt, `iss` = the issuer, `aud` = this server's resource URL, `exp`. Stateless, so a
//     revoked grant's JWT keeps working until it expires (ACCESS_TTL on the AS);
//   - anything else (ACCESS_TOKEN_FORMAT=opaque on the AS): RFC 7662 introspection at the AS with
//     the RS client's credentials; `active`, `iss`, `aud` and `token_type` Bearer are required,
//     so revocation is visible on the very next request.
import { createHash } from 'node:crypto';
import { createServer } from 'node:http';
import { appendFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { pathToFileURL } from 'node:url';
import { EmbeddedJWK, calculateJwkThumbprint, createRemoteJWKSet, decodeProtectedHeader, jwtVerify } from 'jose';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';

const MCP_PATH = '/mcp';
const PRM_PATH = '/.well-known/oauth-protected-resource/mcp';
const BODY_LIMIT = 1024 * 1024;

function splitList(value) {
  return String(value ?? '').split(/[\s,]+/).filter(Boolean);
}

export function optionsFromEnv(env = process.env) {
  const port = env.PORT === undefined || env.PORT === '' ? 0 : Number(env.PORT);
  if (!Number.isSafeInteger(port) || port < 0 || port > 65535) throw new Error(`PORT must be 0..65535, got ${env.PORT}`);
  const wait = env.ISSUER_WAIT_MS === undefined ? 10000 : Number(env.ISSUER_WAIT_MS);
  return {
    port,
    asIssuer: env.AS_ISSUER || undefined,
    scopes: env.MCP_SCOPES === undefined ? ['mcp:tools'] : splitList(env.MCP_SCOPES),
    requiredScopes: splitList(env.REQUIRED_SCOPES),
    rsClient: {
      id: env.RS_CLIENT_ID || 'iteron-test-rs',
      secret: env.RS_CLIENT_SECRET || 'iteron-test-rs-secret',
    },
    issuerWaitMs: Number.isFinite(wait) && wait >= 0 ? wait : 10000,
    requestLog: env.REQUEST_LOG || undefined,
    // The resource is the bare origin (no path, no trailing slash) instead of the endpoint.
    resourceAtOrigin: env.RESOURCE_AT_ORIGIN === '1',
  };
}

function checkIssuer(value) {
  const parsed = URL.parse(value);
  if (!parsed || !['http:', 'https:'].includes(parsed.protocol) || parsed.search || parsed.hash) {
    throw new Error(`not an issuer URL: ${value}`);
  }
  return value;
}

class Rejection extends Error {
  constructor(status, error, description, scope) {
    super(description);
    Object.assign(this, { status, error, description, scope });
  }
}

function quoted(value) {
  return `"${String(value).replace(/["\\]/g, '')}"`;
}

// application/x-www-form-urlencoded encoding of client credentials before HTTP Basic (RFC 6749 §2.3.1).
function basicAuth(id, secret) {
  const enc = (s) => encodeURIComponent(s).replace(/%20/g, '+');
  return `Basic ${Buffer.from(`${enc(id)}:${enc(secret)}`).toString('base64')}`;
}

export async function startMcpServer(options) {
  const o = { ...options };
  const log = o.requestLog
    ? (entry) => {
      try {
        appendFileSync(o.requestLog, `${JSON.stringify({ t: Date.now() / 1000, who: 'mcp', ...entry })}\n`);
      } catch (err) {
        process.stderr.write(`mcp_server: cannot write REQUEST_LOG: ${err.message}\n`);
      }
    }
    : () => {};

  let issuer = o.asIssuer ? checkIssuer(o.asIssuer) : undefined;
  let issuerWaiters = [];
  const asCache = new Map(); // issuer -> Promise<{ metadata, jwks }>

  function setIssuer(value) {
    issuer = checkIssuer(value);
    for (const wake of issuerWaiters) wake();
    issuerWaiters = [];
    return issuer;
  }

  async function currentIssuer() {
    if (issuer) return issuer;
    await new Promise((resolve) => {
      const timer = setTimeout(resolve, o.issuerWaitMs);
      issuerWaiters.push(() => { clearTimeout(timer); resolve(); });
    });
    if (!issuer) throw new Rejection(503, 'temporarily_unavailable', 'authorization server issuer not configured yet');
    return issuer;
  }

  function authServer(iss) {
    if (!asCache.has(iss)) {
      const loading = (async () => {
        const res = await fetch(`${iss}/.well-known/oauth-authorization-server`, { signal: AbortSignal.timeout(5000) });
        if (!res.ok) throw new Error(`AS metadata: HTTP ${res.status}`);
        const metadata = await res.json();
        if (metadata.issuer !== iss) throw new Error(`AS metadata issuer ${metadata.issuer} != ${iss}`);
        return { metadata, jwks: createRemoteJWKSet(new URL(metadata.jwks_uri), { timeoutDuration: 5000 }) };
      })();
      loading.catch(() => asCache.delete(iss));
      asCache.set(iss, loading);
    }
    return asCache.get(iss);
  }

  const server = createServer();
  await new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(o.port, '127.0.0.1', () => {
      server.off('error', reject);
      resolve();
    });
  });
  const { port } = server.address();
  const origin = `http://127.0.0.1:${port}`;
  const endpoint = `${origin}${MCP_PATH}`;
  const resource = o.resourceAtOrigin ? origin : endpoint;
  const prmUrl = `${origin}${PRM_PATH}`;

  // DPoP (RFC 9449): the proof of a request presenting a DPoP-bound token. Its key must be
  // the one the token is bound to (cnf.jkt), for this method, this URL and this token.
  const seenJtis = new Set();
  async function checkProof(req, token, jkt) {
    const proof = req.headers.dpop;
    if (typeof proof !== 'string' || proof.includes(',')) {
      throw new Rejection(401, 'invalid_dpop_proof', 'one DPoP proof is required');
    }
    let payload;
    let protectedHeader;
    try {
      ({ payload, protectedHeader } = await jwtVerify(proof, EmbeddedJWK, { typ: 'dpop+jwt', algorithms: ['ES256'] }));
    } catch (err) {
      throw new Rejection(401, 'invalid_dpop_proof', `DPoP proof rejected: ${err.code ?? err.message}`);
    }
    const ath = createHash('sha256').update(token).digest('base64url');
    if (payload.htm !== req.method || payload.htu !== endpoint || payload.ath !== ath) {
      throw new Rejection(401, 'invalid_dpop_proof', 'DPoP proof not bound to this request or token');
    }
    if (typeof payload.iat !== 'number' || Math.abs(Date.now() / 1000 - payload.iat) > 300) {
      throw new Rejection(401, 'invalid_dpop_proof', 'DPoP proof iat outside the window');
    }
    if (typeof payload.jti !== 'string' || seenJtis.has(payload.jti)) {
      throw new Rejection(401, 'invalid_dpop_proof', 'DPoP proof replayed');
    }
    seenJtis.add(payload.jti);
    if ((await calculateJwkThumbprint(protectedHeader.jwk, 'sha256')) !== jkt) {
      throw new Rejection(401, 'invalid_token', 'the proof key is not the key the token is bound to');
    }
  }

  async function validate(token, dpopRequest) {
    const iss = await currentIssuer();
    let as;
    try {
      as = await authServer(iss);
    } catch (err) {
      throw new Rejection(503, 'temporarily_unavailable', `authorization server unreachable: ${err.message}`);
    }
    let isJws = false;
    try {
      isJws = !!decodeProtectedHeader(token);
    } catch {}
    if (isJws) {
      let payload;
      try {
        ({ payload } = await jwtVerify(token, as.jwks, {
          issuer: iss,
          audience: resource,
          typ: 'at+jwt',
          algorithms: ['RS256', 'PS256', 'ES256', 'EdDSA'],
          requiredClaims: ['exp', 'sub', 'client_id'],
        }));
      } catch (err) {
        throw new Rejection(401, 'invalid_token', `access token rejected: ${err.code ?? err.message}`);
      }
      if (dpopRequest) {
        if (typeof payload.cnf?.jkt !== 'string') throw new Rejection(401, 'invalid_token', 'not a DPoP-bound token');
        await checkProof(dpopRequest, token, payload.cnf.jkt);
      } else if (payload.cnf) {
        throw new Rejection(401, 'invalid_token', 'a sender-constrained token presented as Bearer');
      }
      return {
        sub: payload.sub, scope: payload.scope ?? '', clientId: payload.client_id, aud: payload.aud,
        exp: payload.exp, validatedBy: 'jwt',
      };
    }
    const endpoint = as.metadata.introspection_endpoint;
    if (!endpoint) throw new Rejection(503, 'temporarily_unavailable', 'the authorization server has no introspection endpoint');
    let body;
    try {
      const res = await fetch(endpoint, {
        method: 'POST',
        headers: {
          Authorization: basicAuth(o.rsClient.id, o.rsClient.secret),
          'Content-Type': 'application/x-www-form-urlencoded',
          Accept: 'application/json',
        },
        body: new URLSearchParams({ token, token_type_hint: 'access_token' }).toString(),
        signal: AbortSignal.timeout(5000),
      });
      body = await res.json();
      if (!res.ok) throw new Error(`HTTP ${res.status} ${body?.error ?? ''}`);
    } catch (err) {
      throw new Rejection(503, 'temporarily_unavailable', `introspection failed: ${err.message}`);
    }
    const auds = Array.isArray(body.aud) ? body.aud : [body.aud];
    if (body.active !== true) throw new Rejection(401, 'invalid_token', 'access token is not active');
    if (body.iss !== iss) throw new Rejection(401, 'invalid_token', 'access token from another issuer');
    if (!auds.includes(resource)) throw new Rejection(401, 'invalid_token', 'access token audience is not this resource');
    if (dpopRequest) {
      if (body.token_type !== 'DPoP' || typeof body.cnf?.jkt !== 'string') {
        throw new Rejection(401, 'invalid_token', 'not a DPoP-bound token');
      }
      await checkProof(dpopRequest, token, body.cnf.jkt);
    } else if (body.token_type !== 'Bearer' || body.cnf) {
      throw new Rejection(401, 'invalid_token', 'not a bearer token');
    }
    if (typeof body.exp !== 'number' || body.exp <= Date.now() / 1000) throw new Rejection(401, 'invalid_token', 'access token expired');
    return {
      sub: body.sub, scope: body.scope ?? '', clientId: body.client_id, aud: body.aud, exp: body.exp,
      validatedBy: 'introspection',
    };
  }

  function challenge(res, rej) {
    const parts = [];
    if (rej.error) parts.push(`error=${quoted(rej.error)}`);
    if (rej.error && rej.description) parts.push(`error_description=${quoted(rej.description)}`);
    parts.push(`resource_metadata=${quoted(prmUrl)}`);
    const scope = rej.scope ?? o.scopes.join(' ');
    if (scope) parts.push(`scope=${quoted(scope)}`);
    res.writeHead(rej.status, {
      'WWW-Authenticate': `Bearer ${parts.join(', ')}`,
      'Content-Type': 'application/json',
      'Cache-Control': 'no-store',
    });
    res.end(JSON.stringify(rej.error ? { error: rej.error, error_description: rej.description } : { error: 'unauthorized' }));
  }

  function buildMcp() {
    const mcp = new McpServer({ name: 'iteron-oauth-fixture', version: '0.0.0' });
    mcp.registerTool(
      'whoami',
      { description: 'Report the subject, scope, client and audience of the bearer token used for this call' },
      async (extra) => {
        const info = extra.authInfo;
        const who = {
          sub: info?.extra?.sub ?? null,
          scope: info ? info.scopes.join(' ') : null,
          client_id: info?.clientId ?? null,
          aud: info?.extra?.aud ?? null,
          validated_by: info?.extra?.validatedBy ?? null,
        };
        return { content: [{ type: 'text', text: JSON.stringify(who) }] };
      },
    );
    return mcp;
  }

  async function readJson(req) {
    const chunks = [];
    let size = 0;
    for await (const chunk of req) {
      size += chunk.length;
      if (size > BODY_LIMIT) throw new Rejection(413, undefined, 'request body too large');
      chunks.push(chunk);
    }
    try {
      return JSON.parse(Buffer.concat(chunks).toString('utf8'));
    } catch {
      return Symbol.for('parse-error');
    }
  }

  function sendJson(res, status, value, headers = {}) {
    res.writeHead(status, { 'Content-Type': 'application/json', 'Cache-Control': 'no-store', ...headers });
    res.end(JSON.stringify(value));
  }

  async function handle(req, res) {
    const path = (req.url ?? '').split('?')[0];
    const entry = { method: req.method, path, has_authorization: req.headers.authorization !== undefined };
    res.on('finish', () => log({ ...entry, status: res.statusCode }));

    if (path === PRM_PATH) {
      if (req.method !== 'GET' && req.method !== 'HEAD') {
        sendJson(res, 405, { error: 'method_not_allowed' }, { Allow: 'GET, HEAD' });
        return;
      }
      const iss = await currentIssuer();
      const prm = { resource, authorization_servers: [iss] };
      if (o.scopes.length) prm.scopes_supported = o.scopes;
      sendJson(res, 200, prm);
      return;
    }
    if (path !== MCP_PATH) {
      sendJson(res, 404, { error: 'not_found' });
      return;
    }

    const header = req.headers.authorization ?? '';
    const m = /^(Bearer|DPoP) +([A-Za-z0-9\-._~+/]+=*) *$/i.exec(header);
    if (!m) {
      // No credentials (or not a Bearer one): RFC 6750 §3.1 says no error code in that case.
      throw header
        ? new Rejection(401, 'invalid_request', 'malformed Authorization header')
        : new Rejection(401, undefined, 'no bearer token');
    }
    // Which token was presented, never the token: tests prove that a token was never sent.
    const dpop = m[1].toLowerCase() === 'dpop';
    entry.scheme = dpop ? 'DPoP' : 'Bearer';
    entry.token_sha256 = createHash('sha256').update(m[2]).digest('hex').slice(0, 16);
    const who = await validate(m[2], dpop ? req : undefined);
    entry.sub = who.sub;
    const granted = new Set(splitList(who.scope));
    const lacking = o.requiredScopes.filter((s) => !granted.has(s));
    if (lacking.length) {
      throw new Rejection(403, 'insufficient_scope', 'the access token lacks a required scope', o.requiredScopes.join(' '));
    }

    if (req.method !== 'POST') {
      sendJson(res, 405, { jsonrpc: '2.0', error: { code: -32000, message: 'Method not allowed.' }, id: null }, { Allow: 'POST' });
      return;
    }
    const body = await readJson(req);
    if (body === Symbol.for('parse-error')) {
      sendJson(res, 400, { jsonrpc: '2.0', error: { code: -32700, message: 'Parse error' }, id: null });
      return;
    }
    entry.rpc = Array.isArray(body) ? body.map((b) => b?.method) : body?.method;

    req.auth = {
      token: m[1],
      clientId: who.clientId,
      scopes: [...granted],
      expiresAt: who.exp,
      resource: new URL(resource),
      extra: { sub: who.sub, aud: who.aud, validatedBy: who.validatedBy },
    };
    const mcp = buildMcp();
    const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse: true });
    res.on('close', () => {
      transport.close();
      mcp.close();
    });
    await mcp.connect(transport);
    await transport.handleRequest(req, res, body);
  }

  server.on('request', (req, res) => {
    handle(req, res).catch((err) => {
      if (res.headersSent) {
        res.destroy();
        return;
      }
      if (err instanceof Rejection && (err.status === 401 || err.status === 403)) {
        challenge(res, err);
      } else if (err instanceof Rejection) {
        sendJson(res, err.status, { error: err.error ?? 'error', error_description: err.description });
      } else {
        process.stderr.write(`mcp_server: ${err.stack ?? err}\n`);
        sendJson(res, 500, { error: 'server_error' });
      }
    });
  });

  return {
    port,
    resource,
    prmUrl,
    server,
    setIssuer,
    close: () => new Promise((resolve) => { server.close(() => resolve()); server.closeAllConnections(); }),
  };
}

async function main() {
  const started = await startMcpServer(optionsFromEnv());
  process.stdout.write(`LISTENING ${started.port}\n`);
  const lines = createInterface({ input: process.stdin, terminal: false });
  lines.on('line', (line) => {
    const value = line.trim();
    if (!value) return;
    try {
      process.stdout.write(`AS_ISSUER ${started.setIssuer(value)}\n`);
    } catch (err) {
      process.stdout.write(`AS_ISSUER_ERROR ${err.message}\n`);
    }
  });
  lines.on('error', () => {});
  for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => process.exit(0));
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  main().catch((err) => {
    process.stderr.write(`mcp_server: ${err.stack ?? err}\n`);
    process.exit(1);
  });
}
