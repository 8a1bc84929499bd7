// A real OpenID Connect issuer for kvcdn's hosted tests, on 127.0.0.1 only.
//
// oidc-provider with: RS256 JWT access tokens through resource indicators, the device flow and the
// authorization-code flow with PKCE for the public client `kvcdn-cli`, and a login page that checks
// a password (no dev interactions). Tests drive the pages with an HTTP client as a browser would.
//
//   node issuer.mjs [--port 0]       prints one line `READY <issuer url>` once it listens
//
// Resource servers (the `resource` parameter; the default is the first):
//   https://api.kvcdn.test/      audience `kvcdn-cli`  access tokens live 300 s
//   https://short.kvcdn.test/    audience `kvcdn-cli`  access tokens live 1 s (expiry tests)
//   https://other.kvcdn.test/    audience `other-api`  (wrong-audience tests)
import crypto from 'node:crypto';
import http from 'node:http';
import { parseArgs } from 'node:util';

import Provider from 'oidc-provider';

const ACCOUNTS = {
  alice: { password: 'alice-password', email: 'alice@example.test' },
  bob: { password: 'bob-password', email: 'bob@example.test' },
};

const RESOURCES = {
  'https://api.kvcdn.test/': { audience: 'kvcdn-cli', ttl: 300 },
  'https://short.kvcdn.test/': { audience: 'kvcdn-cli', ttl: 1 },
  'https://other.kvcdn.test/': { audience: 'other-api', ttl: 300 },
};
const DEFAULT_RESOURCE = 'https://api.kvcdn.test/';
const API_SCOPES = 'kvcdn';

const { values: args } = parseArgs({ options: { port: { type: 'string', default: '0' } } });

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function page(res, status, title, body) {
  res.statusCode = status;
  res.setHeader('Content-Type', 'text/html; charset=utf-8');
  res.setHeader('Cache-Control', 'no-store');
  res.end(`<!doctype html><html><head><title>${escapeHtml(title)}</title></head><body>`
    + `<h1>${escapeHtml(title)}</h1>${body}</body></html>`);
}

async function readForm(req) {
  const chunks = [];
  let size = 0;
  for await (const chunk of req) {
    size += chunk.length;
    if (size > 16384) throw new Error('form too large');
    chunks.push(chunk);
  }
  return Object.fromEntries(new URLSearchParams(Buffer.concat(chunks).toString('utf8')));
}

function loginForm(uid, message = '') {
  return `${message ? `<p class="error">${escapeHtml(message)}</p>` : ''}`
    + `<form method="post" action="/interaction/${escapeHtml(uid)}/login">`
    + '<input name="login" autocomplete="username"> <input name="password" type="password">'
    + '<button type="submit">Sign in</button></form>';
}

async function grantConsent(provider, details) {
  const { prompt: { details: missing }, params, session } = details;
  let grant;
  if (details.grantId) {
    grant = await provider.Grant.find(details.grantId);
  } else {
    grant = new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
  }
  if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(' '));
  if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
  if (missing.missingResourceScopes) {
    for (const [indicator, scopes] of Object.entries(missing.missingResourceScopes)) {
      grant.addResourceScope(indicator, scopes.join(' '));
    }
  }
  return grant.save();
}

async function interactions(provider, req, res) {
  const url = new URL(req.url, 'http://127.0.0.1');
  const match = url.pathname.match(/^\/interaction\/([A-Za-z0-9_-]+)(\/login)?$/);
  if (!match) return false;
  const details = await provider.interactionDetails(req, res);
  if (details.uid !== match[1]) {
    page(res, 400, 'Bad interaction', '<p>Interaction does not match the session.</p>');
    return true;
  }
  if (details.prompt.name === 'login') {
    if (req.method === 'GET') {
      page(res, 200, 'Sign in to the kvcdn test issuer', loginForm(details.uid));
      return true;
    }
    if (req.method === 'POST' && match[2]) {
      const form = await readForm(req);
      const account = ACCOUNTS[form.login];
      const given = Buffer.from(String(form.password || ''));
      const wanted = Buffer.from(account ? account.password : 'x'.repeat(given.length || 1));
      const ok = account && given.length === wanted.length && crypto.timingSafeEqual(given, wanted);
      if (!ok) {
        page(res, 401, 'Sign in to the kvcdn test issuer', loginForm(details.uid, 'Invalid login or password.'));
        return true;
      }
      await provider.interactionFinished(req, res, { login: { accountId: form.login } },
        { mergeWithLastSubmission: false });
      return true;
    }
  }
  if (details.prompt.name === 'consent') {
    // kvcdn-cli is a first-party client: consent is granted without a page.
    const grantId = await grantConsent(provider, details);
    await provider.interactionFinished(req, res, { consent: { grantId } }, { mergeWithLastSubmission: true });
    return true;
  }
  page(res, 400, 'Unsupported interaction', `<p>${escapeHtml(details.prompt.name)}</p>`);
  return true;
}

function makeProvider(issuer, jwk) {
  return new Provider(issuer, {
    clients: [{
      client_id: 'kvcdn-cli',
      application_type: 'native',
      token_endpoint_auth_method: 'none',
      grant_types: ['authorization_code', 'refresh_token', 'urn:ietf:params:oauth:grant-type:device_code'],
      response_types: ['code'],
      redirect_uris: ['http://127.0.0.1/callback'],
    }],
    jwks: { keys: [jwk] },
    findAccount: async (_ctx, id) => (ACCOUNTS[id] ? {
      accountId: id,
      claims: async () => ({ sub: id, email: ACCOUNTS[id].email, email_verified: true }),
    } : undefined),
    claims: { openid: ['sub'], email: ['email', 'email_verified'] },
    scopes: ['openid', 'offline_access', 'email', API_SCOPES],
    interactions: { url: async (_ctx, interaction) => `/interaction/${interaction.uid}` },
    cookies: { keys: [crypto.randomBytes(32).toString('hex')] },
    pkce: { required: () => true },
    features: {
      devInteractions: { enabled: false },
      deviceFlow: { enabled: true },
      revocation: { enabled: true },
      resourceIndicators: {
        enabled: true,
        defaultResource: async (_ctx, _client, oneOf) => oneOf || DEFAULT_RESOURCE,
        useGrantedResource: async () => true,
        getResourceServerInfo: async (_ctx, indicator) => {
          const info = RESOURCES[indicator];
          if (!info) throw new Provider.errors.InvalidTarget();
          return {
            scope: API_SCOPES,
            audience: info.audience,
            accessTokenTTL: info.ttl,
            accessTokenFormat: 'jwt',
            jwt: { sign: { alg: 'RS256' } },
          };
        },
      },
    },
    extraTokenClaims: async (_ctx, token) => {
      if (!token.accountId || !ACCOUNTS[token.accountId]) return undefined;
      return { email: ACCOUNTS[token.accountId].email };
    },
    ttl: {
      DeviceCode: 600,
      Interaction: 600,
      Session: 3600,
      Grant: 3600,
      AuthorizationCode: 60,
      RefreshToken: 3600,
      IdToken: 300,
      // AccessToken: the resource server's accessTokenTTL (see RESOURCES).
    },
  });
}

const server = http.createServer();
server.listen(Number(args.port), '127.0.0.1', () => {
  const { port } = server.address();
  const issuer = `http://127.0.0.1:${port}`;
  const { privateKey } = crypto.generateKeyPairSync('rsa', { modulusLength: 2048 });
  const jwk = { ...privateKey.export({ format: 'jwk' }), use: 'sig', alg: 'RS256', kid: crypto.randomBytes(8).toString('hex') };
  const provider = makeProvider(issuer, jwk);
  const callback = provider.callback();
  server.on('request', async (req, res) => {
    try {
      if (await interactions(provider, req, res)) return;
    } catch (err) {
      page(res, 400, 'Interaction failed', `<p>${escapeHtml(err.message)}</p>`);
      return;
    }
    callback(req, res);
  });
  process.stdout.write(`READY ${issuer}\n`);
});

for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => server.close(() => process.exit(0)));
}
