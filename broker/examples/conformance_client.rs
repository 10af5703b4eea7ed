//! The client the official MCP conformance suite drives (`tests/mcp_conformance/run.py`).
//!
//! Contract (from the suite's runner): the server URL is the last argument;
//! `MCP_CONFORMANCE_SCENARIO` names the scenario, `MCP_CONFORMANCE_PROTOCOL_VERSION` the version
//! under test, and `MCP_CONFORMANCE_CONTEXT` (JSON) carries scenario data. It uses Iteron's own
//! client exactly as the broker does — the same network layer (loopback zone), the same
//! negotiation, envelope, headers and MRTR code — with the version pinned to the one under test
//! and an elicitor that accepts forms with their defaults (the suite's scenarios expect that).
//! Exit code 0 when the scenario's client side completed, 1 otherwise.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test driver: any failure is reported and exits non-zero"
)]

use std::collections::HashMap;
use std::sync::Arc;

use iteron_broker::mcp::client::{
    AccessToken, Client, McpError, Options, TokenFuture, TokenSource,
};
use iteron_broker::mcp::elicit::AcceptDefaults;
use iteron_broker::mcp::version::{Version, VersionPolicy};
use iteron_broker::mcp::{TransportError, TransportErrorKind};
use iteron_broker::net::{Net, NetConfig, ZoneClient};
use iteron_broker::oauth::dpop::DpopKey;
use iteron_broker::oauth::flow::{self, ClientKind, ClientSettings, Mode, OAuthClient, TokenAuth};
use iteron_broker::oauth::grant::{
    self, GrantRequest, IdentityProvider, IdentitySource, IdentityToken, Kind,
};
use iteron_broker::oauth::jose::SigningKey;
use iteron_broker::oauth::metadata;
use iteron_broker::oauth::{Challenge, ExposeSecret, SecretString};
use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::Zone;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue};
use serde_json::{Map, Value, json};

/// The redirect URI the suite's mock authorization servers accept; nothing listens on it: the
/// headless login below reads the authorization redirect's `Location` instead of following it.
const REDIRECT_URI: &str = "http://localhost:3000/callback";
/// The client ID metadata document URL the suite expects (hard-coded in the suite).
const CIMD_URL: &str = "https://conformance-test.local/client-metadata.json";
/// Most authorizations in one run (the suite's retry-limit scenario allows three).
const MAX_AUTHORIZATIONS: usize = 3;

/// The conformance client plays the operator: when a server asks for authorization it logs in
/// (an explicit login each time — the operator CLI never does this on its own). When the server
/// names another authorization server (`auth/authorization-server-migration`) it follows, as an
/// operator accepting the move does with `auth login --oauth-issuer <new>` (the CLI refuses the
/// move until then; see docs/oauth.md). Clients are kept per issuer and never reused across
/// issuers; from 2026-07-28 on, a re-authorization asks for the union of the scopes requested
/// before and the challenged ones.
struct Login {
    http: ZoneClient,
    server: EndpointUrl,
    settings: ClientSettings,
    /// The noninteractive grant the scenario is about (its context carries the client's own
    /// credentials), instead of a browser login.
    grant: Option<Kind>,
    /// The workload's identity token (`auth/wif-jwt-bearer`: the context's valid one).
    identity: Option<IdentityToken>,
    /// Ask for DPoP-bound tokens (`auth/dpop`, `auth/dpop-nonce`).
    dpop: bool,
    /// The enterprise identity provider (`auth/enterprise-managed-authorization`).
    idp: Option<IdentityProvider>,
    clients: HashMap<String, OAuthClient>,
    requested: Vec<String>,
    union: bool,
    attempts: usize,
}

impl Login {
    async fn login(&mut self, challenge: Option<&Challenge>) -> Result<AccessToken, String> {
        self.attempts += 1;
        if self.attempts > MAX_AUTHORIZATIONS {
            return Err(format!(
                "still unauthorized after {MAX_AUTHORIZATIONS} authorizations"
            ));
        }
        let prm = metadata::discover_resource(&self.http, &self.server, challenge, None)
            .await
            .map_err(|e| e.to_string())?;
        let issuer = prm.authorization_servers[0].clone();
        if let Some(kind) = self.grant {
            // The operator's configuration, played from the context: a pre-registered client
            // pinned to the issuer the resource names.
            let auth = if self.settings.client_key.is_some() {
                TokenAuth::PrivateKeyJwt
            } else if self.settings.client_secret.is_some() {
                TokenAuth::Basic
            } else {
                TokenAuth::None
            };
            let req = GrantRequest {
                server: self.server.clone(),
                resource: None,
                issuer: issuer.clone(),
                scopes: None,
                client: OAuthClient {
                    id: self.settings.client_id.clone().unwrap_or_default(),
                    secret: self.settings.client_secret.clone(),
                    key: self.settings.client_key.clone(),
                    dpop: None,
                    auth,
                    kind: ClientKind::PreRegistered,
                    issuer,
                },
                kind,
                identity: self.identity.clone(),
                dpop: self.dpop,
                idp: self.idp.clone(),
            };
            let out = grant::obtain(&self.http, &req, challenge)
                .await
                .map_err(|e| e.to_string())?;
            return Ok(AccessToken {
                token: out.tokens.access,
                dpop: out.client.dpop,
            });
        }
        let meta = metadata::discover_server(&self.http, &issuer)
            .await
            .map_err(|e| e.to_string())?;
        let mut client = match self.clients.get(&issuer) {
            Some(c) => c.clone(),
            None => {
                let c =
                    flow::register(&self.http, &meta, &Mode::Auto, &self.settings, REDIRECT_URI)
                        .await
                        .map_err(|e| e.to_string())?;
                self.clients.insert(issuer.clone(), c.clone());
                c
            }
        };
        if self.dpop {
            client.dpop = Some(Arc::new(DpopKey::generate().map_err(|e| e.to_string())?));
        }
        let chosen = flow::choose_scope(
            None,
            None,
            challenge.and_then(|c| c.scope.as_deref()),
            &prm.scopes_supported,
            &meta.scopes_supported,
        );
        let mut scopes: Vec<String> = if self.union {
            self.requested.clone()
        } else {
            Vec::new()
        };
        for s in chosen.iter().flat_map(|c| c.split(' ')) {
            if !s.is_empty() && !scopes.iter().any(|x| x == s) {
                scopes.push(s.to_owned());
            }
        }
        for s in &scopes {
            if !self.requested.contains(s) {
                self.requested.push(s.clone());
            }
        }
        let scope = (!scopes.is_empty()).then(|| scopes.join(" "));
        let attempt = flow::start(&meta, &client, REDIRECT_URI, &prm.resource, scope)
            .map_err(|e| e.to_string())?;
        // Headless: ask the authorization endpoint, do not follow its redirect, read where it
        // would send the browser.
        let browser = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| e.to_string())?;
        let resp = browser
            .get(&attempt.url)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let location = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or("the authorization endpoint did not redirect")?
            .to_owned();
        let code = flow::finish(&attempt, &location).map_err(|e| e.to_string())?;
        let tokens = flow::exchange(&self.http, &meta, &client, &attempt, code)
            .await
            .map_err(|e| e.to_string())?;
        Ok(AccessToken {
            token: tokens.access,
            dpop: client.dpop,
        })
    }
}

/// The token the last login gave, as the client's managed token (a DPoP-bound token needs its
/// proof on every request, so the transport asks for it before each one); a new login replaces
/// it; a 401 presents it once more.
struct Fixed(std::sync::Mutex<AccessToken>);

impl Fixed {
    fn replace(&self, token: &AccessToken) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = token.clone();
    }
}

impl TokenSource for Fixed {
    fn current(&self) -> TokenFuture<'_> {
        let t = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        Box::pin(async move { Ok(t) })
    }

    fn refresh(&self) -> TokenFuture<'_> {
        self.current()
    }
}

fn unauthorized(e: &McpError) -> Option<Option<Challenge>> {
    match e {
        McpError::Transport(TransportError {
            kind: TransportErrorKind::Unauthorized { challenge, .. },
            ..
        }) => Some(challenge.clone()),
        _ => None,
    }
}

fn args(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

async fn run(
    url: &str,
    scenario: &str,
    version: Option<Version>,
    context: Value,
) -> Result<(), String> {
    let net = Net::new(NetConfig::default()).map_err(|e| e.to_string())?;
    let client = net.client(Zone::Loopback).map_err(|e| e.to_string())?;
    let url = EndpointUrl::parse(url).map_err(|e| e.to_string())?;
    let opts = Options {
        version: version.map_or(VersionPolicy::Auto, VersionPolicy::Pin),
        name: "iteron-conformance-client".into(),
        elicitor: Some(Arc::new(AcceptDefaults)),
        ..Options::default()
    };
    let text = |k: &str| context.get(k).and_then(Value::as_str).map(str::to_owned);
    let mut login = Login {
        http: client.clone(),
        server: url.clone(),
        settings: ClientSettings {
            client_id: text("client_id"),
            client_secret: text("client_secret").map(SecretString::from),
            client_key: match text("private_key_pem") {
                Some(pem) => Some(Arc::new(
                    SigningKey::from_pem(&pem).map_err(|e| e.to_string())?,
                )),
                None => None,
            },
            cimd_url: Some(CIMD_URL.into()),
            client_name: "iteron-conformance-client".into(),
        },
        grant: match scenario {
            "auth/client-credentials-basic" | "auth/client-credentials-jwt" => {
                Some(Kind::ClientCredentials)
            }
            "auth/wif-jwt-bearer" => Some(Kind::JwtBearer),
            "auth/enterprise-managed-authorization" => Some(Kind::IdJag),
            _ => None,
        },
        idp: match (text("idp_issuer"), text("idp_client_id")) {
            (Some(issuer), Some(id)) => Some(IdentityProvider {
                issuer: issuer.clone(),
                client: OAuthClient {
                    id,
                    secret: None,
                    key: None,
                    dpop: None,
                    auth: TokenAuth::None,
                    kind: ClientKind::PreRegistered,
                    issuer,
                },
            }),
            _ => None,
        },
        dpop: scenario.starts_with("auth/dpop"),
        identity: text("valid_jwt").or_else(|| text("idp_id_token")).map(|t| {
            IdentityToken::new(IdentitySource::Value(
                SecretString::from(t),
                "of the scenario context".into(),
            ))
        }),
        clients: HashMap::new(),
        requested: Vec::new(),
        union: version.is_some_and(|v| v.is_modern()),
        attempts: 0,
    };
    let mut bearer: Option<AccessToken> = None;
    // The managed token of a DPoP-bound login (its source, which later logins update).
    let mut managed: Option<Arc<Fixed>> = None;
    let mcp = loop {
        let mut headers = HeaderMap::new();
        let mut opts = opts.clone();
        match &bearer {
            // A DPoP-bound token is installed by the client itself, with a proof per request.
            Some(b) if b.dpop.is_some() => {
                let fixed = Arc::new(Fixed(std::sync::Mutex::new(b.clone())));
                managed = Some(Arc::clone(&fixed));
                opts.token = Some(fixed);
            }
            Some(b) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {}", b.token.expose_secret()))
                    .map_err(|e| e.to_string())?;
                v.set_sensitive(true);
                headers.insert(AUTHORIZATION, v);
            }
            None => {}
        }
        match Client::connect_http(client.clone(), url.clone(), headers, opts).await {
            Ok(c) => break c,
            Err(e) => match unauthorized(&e) {
                Some(challenge) => bearer = Some(login.login(challenge.as_ref()).await?),
                None => return Err(format!("connect: {e}")),
            },
        }
    };
    if let Some(b) = &bearer {
        mcp.set_access(b);
    }
    // Every operation: when the server asks for (more) authorization, log in and try again —
    // a request that got a 401/403 was refused before it ran, so repeating it is safe.
    macro_rules! authed {
        ($op:expr) => {
            loop {
                match $op.await {
                    Err(e) => match unauthorized(&e) {
                        Some(challenge) => {
                            let token = login.login(challenge.as_ref()).await?;
                            // A managed token is asked of its source before every request.
                            match &managed {
                                Some(fixed) => fixed.replace(&token),
                                None => mcp.set_access(&token),
                            }
                        }
                        None => break Err(e),
                    },
                    Ok(v) => break Ok(v),
                }
            }
        };
    }
    let e = |what: &str| {
        let what = what.to_owned();
        move |err: iteron_broker::mcp::client::McpError| format!("{what}: {err}")
    };
    match scenario {
        "initialize" => {}
        "tools_call" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            mcp.call_tool("add_numbers", args(json!({"a": 5, "b": 3})))
                .await
                .map_err(e("tools/call"))?;
        }
        "elicitation-sep1034-client-defaults" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            mcp.call_tool("test_client_elicitation_defaults", Map::new())
                .await
                .map_err(e("tools/call"))?;
        }
        "sep-2322-client-request-state" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            for tool in [
                "test_mrtr_echo_state",
                "test_mrtr_unrelated",
                "test_mrtr_no_state",
                "test_mrtr_no_result_type",
            ] {
                mcp.call_tool(tool, Map::new()).await.map_err(e(tool))?;
            }
        }
        "http-standard-headers" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            for tool in ["test_headers", "my-hyphenated-tool"] {
                mcp.call_tool(tool, Map::new()).await.map_err(e(tool))?;
            }
            for uri in [
                "file:///path/to/file%20name.txt",
                "https://example.com/resource?id=123",
            ] {
                mcp.read_resource(uri).await.map_err(e("resources/read"))?;
            }
            mcp.get_prompt("test_prompt", Map::new())
                .await
                .map_err(e("prompts/get"))?;
        }
        "http-custom-headers" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            let calls = context
                .get("toolCalls")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for call in calls {
                let name = call
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                let arguments = call
                    .get("arguments")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                mcp.call_tool(&name, arguments)
                    .await
                    .map_err(e("tools/call"))?;
            }
        }
        "http-invalid-tool-headers" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            mcp.call_tool("valid_tool", Map::new())
                .await
                .map_err(e("tools/call"))?;
        }
        "json-schema-2020-12-preservation" => {
            let tools = mcp.list_tools().await.map_err(e("tools/list"))?;
            let schema = tools
                .iter()
                .find(|t| t.name == "json_schema_2020_12_tool")
                .map(|t| t.input_schema.clone())
                .ok_or("json_schema_2020_12_tool is not listed")?;
            mcp.call_tool("json_schema_echo", args(json!({"schema": schema})))
                .await
                .map_err(e("tools/call"))?;
        }
        s if s.starts_with("auth/") => {
            let tools = authed!(mcp.list_tools()).map_err(e("tools/list"))?;
            if let Some(t) = tools
                .iter()
                .find(|t| t.name == "test-tool")
                .or(tools.first())
            {
                let name = t.name.clone();
                authed!(mcp.call_tool(&name, Map::new())).map_err(e("tools/call"))?;
            }
        }
        // request-metadata, json-schema-ref-no-deref and anything else: list the tools.
        _ => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
        }
    }
    mcp.close().await;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let url = std::env::args().next_back().unwrap_or_default();
    let scenario = std::env::var("MCP_CONFORMANCE_SCENARIO").unwrap_or_default();
    let version = std::env::var("MCP_CONFORMANCE_PROTOCOL_VERSION")
        .ok()
        .and_then(|v| Version::parse(&v));
    let context: Value = std::env::var("MCP_CONFORMANCE_CONTEXT")
        .ok()
        .and_then(|c| serde_json::from_str(&c).ok())
        .unwrap_or(Value::Null);
    match run(&url, &scenario, version, context).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("conformance client: {scenario}: {why}");
            std::process::ExitCode::FAILURE
        }
    }
}
