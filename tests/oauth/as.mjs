// A real OAuth 2.1 authorization server for Iteron's OAuth tests: oidc-provider 9.13.3 behind a
// small wrapper that binds 127.0.0.1, answers its own login/consent interactions automatically
// (no HTML form) and issues tokens for exactly one protected resource, the fixture MCP server.
//
// Run: node as.mjs   (configuration from the environment, see README.md; MCP_RESOURCE is required)
// Prints "LISTENING <port>" on stdout once requests are served. Issuer: http://127.0.0.1:<port>.
//
// What the wrapper decides on top of the library defaults:
//   - open dynamic client registration at /reg, revocation, introspection;
//   - PKCE (S256, the only method 9.x knows) required for every client;
//   - RFC 8707: the only resource is MCP_RESOURCE (anything else: invalid_target); its access
//     tokens carry aud = MCP_RESOURCE and the granted subset of MCP_SCOPES; with REQUIRE_RESOURCE
//     (the default) a missing `resource` on /auth, on the code exchange or on a refresh is refused
//     before anything is consumed;
//   - a refresh token whenever the client may use the refresh_token grant, rotated on every use
//     (a rotated token presented again is refused and, by the library's reuse detection, revokes
//     the whole grant);
//   - tokens do not expire with the browser session (a CLI keeps them after the login);
//   - a fixed test account, a pre-registered client and an introspection client from the env.
import { createServer } from 'node:http';
import { appendFileSync } from 'node:fs';
import { createPublicKey, generateKeyPairSync, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import Provider, { errors } from 'oidc-provider';

// Scopes that oidc-provider itself knows (OIDC scopes). Everything else a client may obtain is a
// resource scope of MCP_RESOURCE.
const STATIC_SCOPES = ['openid', 'offline_access'];
const TOKEN_BODY_LIMIT = 56 * 1024; // the library's own limit for form bodies
const INTERACTION_PATH = /^\/interaction\/([A-Za-z0-9_-]{1,64})$/;

function splitList(value) {
  return String(value ?? '').split(/[\s,]+/).filter(Boolean);
}

function flag(value, fallback) {
  if (value === undefined || value === '') return fallback;
  return !['0', 'false', 'no', 'off'].includes(String(value).toLowerCase());
}

function positiveInt(name, value, fallback) {
  if (value === undefined || value === '') return fallback;
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n <= 0) throw new Error(`${name} must be a positive integer, got ${value}`);
  return n;
}

// Reads the test configuration from an environment object (process.env by default).
export function optionsFromEnv(env = process.env) {
  const authMethod = env.PRE_CLIENT_AUTH_METHOD || 'client_secret_basic';
  return {
    port: positiveIntOrZero(env.PORT),
    mcpResource: env.MCP_RESOURCE,
    mcpScopes: env.MCP_SCOPES === undefined ? ['mcp:tools'] : splitList(env.MCP_SCOPES),
    accessTtl: positiveInt('ACCESS_TTL', env.ACCESS_TTL, 60),
    refreshTtl: positiveInt('REFRESH_TTL', env.REFRESH_TTL, 3600),
    accessTokenFormat: env.ACCESS_TOKEN_FORMAT || 'jwt',
    requireResource: flag(env.REQUIRE_RESOURCE, true),
    rejectUnknownScopes: flag(env.REJECT_UNKNOWN_SCOPES, false),
    account: env.TEST_ACCOUNT || 'iteron-test-user',
    preClient: env.PRE_CLIENT_ID
      ? {
        id: env.PRE_CLIENT_ID,
        secret: env.PRE_CLIENT_SECRET,
        authMethod,
        redirectUris: env.PRE_CLIENT_REDIRECT_URIS === undefined
          ? ['http://127.0.0.1/callback']
          : splitList(env.PRE_CLIENT_REDIRECT_URIS),
      }
      : undefined,
    // A client-credentials client (no browser, no user): authenticated with a secret (basic or
    // post) or with private_key_jwt against the public half of CC_CLIENT_KEY_FILE.
    ccClient: env.CC_CLIENT_ID
      ? {
        id: env.CC_CLIENT_ID,
        secret: env.CC_CLIENT_SECRET,
        authMethod: env.CC_CLIENT_AUTH_METHOD || 'client_secret_basic',
        keyFile: env.CC_CLIENT_KEY_FILE,
      }
      : undefined,
    rsClient: {
      id: env.RS_CLIENT_ID || 'iteron-test-rs',
      secret: env.RS_CLIENT_SECRET || 'iteron-test-rs-secret',
    },
    requestLog: env.REQUEST_LOG || undefined,
    // RFC 9449 §8: every DPoP proof at the token endpoint must carry a nonce the AS issued.
    dpopRequireNonce: flag(env.DPOP_REQUIRE_NONCE, false),
    // A revocation endpoint that fails: every request to it gets this status (400..599) and
    // nothing is revoked (logout's report of a failed revocation).
    revocationStatus: errorStatus(env.REVOCATION_STATUS),
  };
}

function errorStatus(value) {
  if (value === undefined || value === '') return undefined;
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n < 400 || n > 599) throw new Error(`REVOCATION_STATUS must be 400..599, got ${value}`);
  return n;
}

function positiveIntOrZero(value) {
  if (value === undefined || value === '') return 0;
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n < 0 || n > 65535) throw new Error(`PORT must be 0..65535, got ${value}`);
  return n;
}

function checkOptions(o) {
  if (!o.mcpResource) throw new Error('MCP_RESOURCE is required (the URL of the protected MCP endpoint)');
  const parsed = URL.parse(o.mcpResource);
  if (!parsed || !['http:', 'https:'].includes(parsed.protocol) || parsed.hash || o.mcpResource.includes('#')) {
    throw new Error(`MCP_RESOURCE must be an absolute http(s) URL without a fragment, got ${o.mcpResource}`);
  }
  if (!['jwt', 'opaque'].includes(o.accessTokenFormat)) {
    throw new Error(`ACCESS_TOKEN_FORMAT must be jwt or opaque, got ${o.accessTokenFormat}`);
  }
  if (o.ccClient) {
    const { id, secret, authMethod, keyFile } = o.ccClient;
    if (!['client_secret_basic', 'client_secret_post', 'private_key_jwt'].includes(authMethod)) {
      throw new Error(`CC_CLIENT_AUTH_METHOD must be client_secret_basic, client_secret_post or private_key_jwt, got ${authMethod}`);
    }
    if (authMethod === 'private_key_jwt' ? !keyFile : !secret) {
      throw new Error(authMethod === 'private_key_jwt' ? 'CC_CLIENT_KEY_FILE is required for private_key_jwt' : 'CC_CLIENT_SECRET is required');
    }
    if (id === o.rsClient.id || id === o.preClient?.id) throw new Error('CC_CLIENT_ID must differ from the other clients');
  }
  if (o.preClient) {
    const { id, secret, authMethod, redirectUris } = o.preClient;
    if (!['client_secret_basic', 'client_secret_post', 'none'].includes(authMethod)) {
      throw new Error(`PRE_CLIENT_AUTH_METHOD must be client_secret_basic, client_secret_post or none, got ${authMethod}`);
    }
    if (authMethod !== 'none' && !secret) throw new Error('PRE_CLIENT_SECRET is required unless PRE_CLIENT_AUTH_METHOD=none');
    if (id === o.rsClient.id) throw new Error('PRE_CLIENT_ID must differ from RS_CLIENT_ID');
    if (redirectUris.length === 0) throw new Error('PRE_CLIENT_REDIRECT_URIS is empty');
  }
}

function signingKey() {
  const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
  const jwk = privateKey.export({ format: 'jwk' });
  return { ...jwk, kid: `iteron-test-${randomBytes(6).toString('hex')}`, alg: 'RS256', use: 'sig' };
}

function clientsFor(o) {
  const clients = [{
    // The protected resource's own credentials, used for introspection only (no grants).
    client_id: o.rsClient.id,
    client_secret: o.rsClient.secret,
    token_endpoint_auth_method: 'client_secret_basic',
    grant_types: [],
    response_types: [],
    redirect_uris: [],
  }];
  if (o.ccClient) {
    const { id, secret, authMethod, keyFile } = o.ccClient;
    const jwk = keyFile ? createPublicKey(readFileSync(keyFile)).export({ format: 'jwk' }) : undefined;
    clients.push({
      client_id: id,
      ...(authMethod === 'private_key_jwt' ? { jwks: { keys: [jwk] } } : { client_secret: secret }),
      token_endpoint_auth_method: authMethod,
      grant_types: ['client_credentials'],
      response_types: [],
      redirect_uris: [],
    });
  }
  if (o.preClient) {
    const { id, secret, authMethod, redirectUris } = o.preClient;
    clients.push({
      client_id: id,
      ...(authMethod === 'none' ? {} : { client_secret: secret }),
      // application_type native: oidc-provider then accepts any port on a registered loopback
      // http redirect URI (RFC 8252 §7.3), so http://127.0.0.1/callback matches
      // http://127.0.0.1:<any port>/callback.
      application_type: 'native',
      token_endpoint_auth_method: authMethod,
      grant_types: ['authorization_code', 'refresh_token'],
      response_types: ['code'],
      redirect_uris: redirectUris,
    });
  }
  return clients;
}

function openLog(path) {
  if (!path) return () => {};
  return (entry) => {
    try {
      appendFileSync(path, `${JSON.stringify({ t: Date.now() / 1000, who: 'as', ...entry })}\n`);
    } catch (err) {
      process.stderr.write(`as: cannot write REQUEST_LOG: ${err.message}\n`);
    }
  };
}

// Reads a form body ourselves so that /token requests can be checked before the library consumes
// a code or rotates a refresh token. The library then parses ctx.request.body (it prints a one-time
// "already parsed request body detected" warning about that).
async function readForm(ctx) {
  const chunks = [];
  let size = 0;
  for await (const chunk of ctx.req) {
    size += chunk.length;
    if (size > TOKEN_BODY_LIMIT) {
      const err = new Error('request entity too large');
      err.status = 413;
      throw err;
    }
    chunks.push(chunk);
  }
  const text = Buffer.concat(chunks).toString('utf8');
  ctx.request.body = text;
  return new URLSearchParams(text);
}

function clientAuthKind(ctx, params) {
  const header = ctx.get('authorization');
  if (header) return header.split(' ')[0].toLowerCase();
  if (params?.client_secret !== undefined) return 'client_secret_post';
  if (params?.client_assertion !== undefined) return 'client_assertion';
  return 'none';
}

function redirectSummary(location) {
  const target = location ? URL.parse(location) : null;
  if (!target) return {};
  return {
    redirect_to: `${target.origin}${target.pathname}`,
    redirect_error: target.searchParams.get('error') ?? undefined,
    redirect_has_code: target.searchParams.has('code') || undefined,
  };
}

export async function startAuthServer(options) {
  const o = { ...options };
  checkOptions(o);
  const log = openLog(o.requestLog);
  const mcpScopes = new Set(o.mcpScopes);
  const known = new Set([...STATIC_SCOPES, ...mcpScopes]);

  const server = createServer();
  await new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(o.port, '127.0.0.1', () => {
      server.off('error', reject);
      resolve();
    });
  });
  const { port } = server.address();
  const issuer = `http://127.0.0.1:${port}`;

  const provider = new Provider(issuer, {
    clients: clientsFor(o),
    jwks: { keys: [signingKey()] },
    cookies: { keys: [randomBytes(32).toString('base64url')] },
    responseTypes: ['code'],
    scopes: STATIC_SCOPES,
    pkce: { required: () => true },
    features: {
      devInteractions: { enabled: false },
      registration: { enabled: true, initialAccessToken: false },
      clientCredentials: { enabled: true },
      dPoP: {
        enabled: true,
        ...(o.dpopRequireNonce ? { nonceSecret: randomBytes(32), requireNonce: () => true } : {}),
      },
      // A client may revoke only its own tokens (anything else: 200 without effect, RFC 7009 §2.2).
      revocation: { enabled: true, allowedPolicy: async (_ctx, client, token) => token.clientId === client.clientId },
      // Confidential clients (the RS client, a pre-registered secret client) may introspect any
      // token; a public client only its own.
      introspection: {
        enabled: true,
        allowedPolicy: async (_ctx, client, token) => client.clientAuthMethod !== 'none' || token.clientId === client.clientId,
      },
      resourceIndicators: {
        enabled: true,
        async defaultResource(_ctx, _client, oneOf) {
          if (oneOf) return Array.isArray(oneOf) && oneOf.length === 1 ? oneOf[0] : oneOf;
          if (o.requireResource) {
            throw new errors.InvalidTarget('the resource parameter (RFC 8707) is required by this authorization server');
          }
          return o.mcpResource;
        },
        useGrantedResource: async () => true,
        async getResourceServerInfo(ctx, resource) {
          if (resource !== o.mcpResource) {
            throw new errors.InvalidTarget('unknown resource indicator');
          }
          if (o.rejectUnknownScopes && ctx?.oidc?.route === 'authorization') {
            const unknown = splitList(ctx.oidc.params.scope).filter((s) => !known.has(s));
            if (unknown.length) throw new errors.InvalidScope('requested scope is not supported', unknown.join(' '));
          }
          return {
            scope: [...mcpScopes].join(' '),
            audience: o.mcpResource,
            accessTokenTTL: o.accessTtl,
            accessTokenFormat: o.accessTokenFormat,
            ...(o.accessTokenFormat === 'jwt' ? { jwt: { sign: { alg: 'RS256' } } } : {}),
          };
        },
      },
    },
    issueRefreshToken: async (_ctx, client) => client.grantTypeAllowed('refresh_token'),
    rotateRefreshToken: true,
    expiresWithSession: async () => false,
    ttl: {
      AccessToken: o.accessTtl,
      AuthorizationCode: 60,
      ClientCredentials: o.accessTtl,
      IdToken: 300,
      Interaction: 600,
      RefreshToken: o.refreshTtl,
      Grant: o.refreshTtl,
      Session: 3600,
    },
    findAccount: async (_ctx, sub) => ({ accountId: sub, claims: async () => ({ sub }) }),
    interactions: { url: async (_ctx, interaction) => `/interaction/${interaction.uid}` },
    // Errors as JSON instead of the default HTML page: easier to read from a headless client.
    renderError: async (ctx, out) => {
      ctx.type = 'json';
      ctx.body = out;
    },
  });

  provider.use(async (ctx, next) => {
    let form;
    if (ctx.method === 'POST' && ctx.path === '/token' && ctx.is('application/x-www-form-urlencoded')) {
      form = await readForm(ctx);
      const grantType = form.get('grant_type');
      if (o.requireResource && ['authorization_code', 'refresh_token'].includes(grantType) && !form.get('resource')) {
        ctx.status = 400;
        ctx.set('Cache-Control', 'no-store');
        ctx.body = {
          error: 'invalid_target',
          error_description: 'the resource parameter (RFC 8707) is required by this authorization server',
        };
        log({ method: ctx.method, path: ctx.path, route: 'token', status: 400, client_id: form.get('client_id') ?? undefined,
          client_auth: clientAuthKind(ctx, Object.fromEntries(form)), grant_type: grantType, error: 'invalid_target' });
        return;
      }
    }
    await next();
    const p = ctx.oidc?.params ?? {};
    const raw = form ? Object.fromEntries(form) : {};
    const get = (name) => p[name] ?? raw[name];
    log({
      method: ctx.method,
      path: ctx.path,
      route: ctx.oidc?.route,
      status: ctx.status,
      client_id: ctx.oidc?.client?.clientId ?? get('client_id'),
      client_auth: ['token', 'revocation', 'introspection'].includes(ctx.oidc?.route) ? clientAuthKind(ctx, { ...raw, ...p }) : undefined,
      grant_type: get('grant_type'),
      resource: get('resource'),
      scope: get('scope'),
      redirect_uri: get('redirect_uri'),
      code_challenge_method: get('code_challenge_method'),
      has_code_challenge: get('code_challenge') !== undefined || undefined,
      has_code_verifier: get('code_verifier') !== undefined || undefined,
      has_state: get('state') !== undefined || undefined,
      token_type_hint: get('token_type_hint'),
      error: ctx.body && typeof ctx.body === 'object' && !Buffer.isBuffer(ctx.body) ? ctx.body.error : undefined,
      ...redirectSummary(ctx.response.get('location')),
    });
  });

  // Auto-consent: a login prompt is answered with the fixed account; a consent prompt with a grant
  // holding every OIDC scope, claim and resource scope the library reports as missing.
  async function interaction(req, res, uid) {
    let status = 303;
    try {
      const details = await provider.interactionDetails(req, res);
      if (details.uid !== uid) throw new errors.InvalidRequest('interaction cookie does not match the URL');
      const { prompt, params } = details;
      const result = { login: { accountId: details.session?.accountId ?? o.account } };
      if (prompt.name === 'consent') {
        let grant = details.grantId ? await provider.Grant.find(details.grantId) : undefined;
        grant ??= new provider.Grant({ accountId: result.login.accountId, clientId: params.client_id });
        const missing = prompt.details ?? {};
        if (missing.missingOIDCScope?.length) grant.addOIDCScope(missing.missingOIDCScope.join(' '));
        if (missing.missingOIDCClaims?.length) grant.addOIDCClaims(missing.missingOIDCClaims);
        for (const [indicator, scopes] of Object.entries(missing.missingResourceScopes ?? {})) {
          grant.addResourceScope(indicator, scopes.join(' '));
        }
        result.consent = { grantId: await grant.save() };
      } else if (prompt.name !== 'login') {
        throw new errors.InvalidRequest(`unsupported prompt ${prompt.name}`);
      }
      await provider.interactionFinished(req, res, result, { mergeWithLastSubmission: true });
      log({ method: req.method, path: '/interaction/:uid', status, prompt: prompt.name, client_id: params.client_id });
    } catch (err) {
      status = err.statusCode ?? 500;
      if (!res.headersSent) {
        res.writeHead(status, { 'Content-Type': 'application/json', 'Cache-Control': 'no-store' });
        res.end(JSON.stringify({ error: err.error ?? 'server_error', error_description: err.error_description ?? err.message }));
      }
      log({ method: req.method, path: '/interaction/:uid', status, error: err.error ?? 'server_error' });
    }
  }

  const handle = provider.callback();
  server.on('request', (req, res) => {
    const path = (req.url ?? '').split('?')[0];
    if (o.revocationStatus && path === '/token/revocation') {
      res.writeHead(o.revocationStatus, { 'Content-Type': 'application/json', 'Cache-Control': 'no-store' });
      res.end(JSON.stringify({ error: 'server_error', error_description: 'revocation fails on purpose (REVOCATION_STATUS)' }));
      log({ method: req.method, path, route: 'revocation', status: o.revocationStatus });
      return;
    }
    const m = INTERACTION_PATH.exec(path);
    if (m && req.method === 'GET') {
      interaction(req, res, m[1]);
      return;
    }
    handle(req, res);
  });

  return {
    issuer,
    port,
    provider,
    server,
    close: () => new Promise((resolve) => { server.close(() => resolve()); server.closeAllConnections(); }),
  };
}

async function main() {
  const started = await startAuthServer(optionsFromEnv());
  process.stdout.write(`LISTENING ${started.port}\n`);
  for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => process.exit(0));
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  main().catch((err) => {
    process.stderr.write(`as: ${err.stack ?? err}\n`);
    process.exit(1);
  });
}
