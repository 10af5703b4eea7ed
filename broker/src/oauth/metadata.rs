//! Discovery: protected-resource metadata (RFC 9728) and authorization-server metadata
//! (RFC 8414, OpenID Connect Discovery), fetched in the order the MCP specification gives and
//! validated before anything in them is used.

use reqwest::Method;
use reqwest::header::{ACCEPT, HeaderValue};
use serde_json::Value;

use iteron_policy::url::EndpointUrl;

use super::{Challenge, MAX_OAUTH_BODY, OAuthError, host_of};
use crate::net::{NetError, Request, ZoneClient};

/// Protected-resource metadata, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceMetadata {
    /// The resource identifier (the value to send as `resource`).
    pub resource: String,
    /// Authorization-server issuers, in the server's order.
    pub authorization_servers: Vec<String>,
    /// Scopes the resource lists.
    pub scopes_supported: Vec<String>,
}

/// Authorization-server metadata, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerMetadata {
    /// The issuer, exactly as fetched.
    pub issuer: String,
    /// Where the browser goes (absent for endpoints the operator configured for an externally
    /// managed token, which never involve a browser).
    pub authorization_endpoint: Option<EndpointUrl>,
    /// Where codes and refresh tokens are exchanged.
    pub token_endpoint: EndpointUrl,
    /// RFC 7591 registration, if offered.
    pub registration_endpoint: Option<EndpointUrl>,
    /// RFC 7009 revocation, if offered.
    pub revocation_endpoint: Option<EndpointUrl>,
    /// Token endpoint client authentication methods offered.
    pub token_endpoint_auth_methods: Vec<String>,
    /// Scopes offered.
    pub scopes_supported: Vec<String>,
    /// Whether client ID metadata documents are accepted.
    pub cimd_supported: bool,
    /// Whether the authorization response carries `iss` (RFC 9207).
    pub iss_parameter_supported: bool,
    /// The grant types offered (empty when the metadata does not say).
    pub grant_types_supported: Vec<String>,
}

/// What the metadata will be used for: the rules differ only in what a browser needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The authorization-code flow: an authorization endpoint and PKCE S256 are required, and
    /// the cross-origin authorization-endpoint rule applies.
    AuthorizationCode,
    /// Only the token and revocation endpoints are used (grants without a browser, refresh,
    /// revocation): the issuer must still match exactly and every endpoint pass the rules.
    TokenEndpoint,
}

async fn get_json(http: &ZoneClient, url: &EndpointUrl) -> Result<Option<Value>, OAuthError> {
    let mut req = Request::new(Method::GET, url.clone());
    req.headers
        .insert(ACCEPT, HeaderValue::from_static("application/json"));
    let resp = match http.send(req).await {
        Ok(r) => r,
        // A redirect on a metadata URL is refused and the next candidate is tried; zone
        // refusals and transport failures stop discovery.
        Err(NetError::Redirect { .. }) => return Ok(None),
        Err(e) => return Err(OAuthError::Net(e)),
    };
    if !resp.status().is_success() {
        return Ok(None);
    }
    let body = resp.body(MAX_OAUTH_BODY).await?;
    Ok(serde_json::from_slice(&body).ok())
}

fn strings(v: &Value, key: &str) -> Vec<String> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The entries of a `scopes_supported` list that are RFC 6749 scope tokens (at most
/// [`MAX_LISTED_SCOPES`] of them). Anything else a server lists (controls, spaces, quotes,
/// non-ASCII) is never requested, stored or shown.
fn scope_list(v: &Value, key: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in strings(v, key) {
        if out.len() == MAX_LISTED_SCOPES {
            break;
        }
        if iteron_policy::config::Scope::parse(&s).is_ok() && !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// Most scopes taken from one `scopes_supported` list.
pub const MAX_LISTED_SCOPES: usize = 64;

fn origin(u: &url::Url) -> String {
    u.origin().ascii_serialization()
}

/// Whether a metadata `resource` identifies the server at `server`: the same origin, and a path
/// that is the server's path or a prefix of it (the origin root, `/mcp`, …). Query differences
/// are legal. With an explicit `pinned` resource, the metadata must name it exactly.
pub fn resource_matches(server: &EndpointUrl, resource: &str, pinned: Option<&str>) -> bool {
    // A resource must itself pass the endpoint rules: no control, bidi or invisible
    // character (the URL parser would silently drop or encode them), no userinfo, no fragment.
    let Ok(r) = EndpointUrl::parse(resource) else {
        return false;
    };
    if let Some(p) = pinned {
        return p == resource;
    }
    let r = r.as_url();
    let s = server.as_url();
    if origin(r) != origin(s)
        || r.fragment().is_some()
        || !r.username().is_empty()
        || r.password().is_some()
    {
        return false;
    }
    let rp = r.path().trim_end_matches('/');
    let sp = s.path().trim_end_matches('/');
    rp.is_empty() || sp == rp || sp.starts_with(&format!("{rp}/"))
}

/// Candidate protected-resource metadata URLs: the challenge's `resource_metadata`, then the
/// path-based well-known URL, then the root one.
pub fn resource_candidates(
    server: &EndpointUrl,
    challenge: Option<&Challenge>,
) -> Vec<EndpointUrl> {
    let mut out = Vec::new();
    if let Some(u) = challenge
        .and_then(|c| c.resource_metadata.as_deref())
        .and_then(|u| EndpointUrl::parse(u).ok())
    {
        out.push(u);
    }
    let s = server.as_url();
    let base = origin(s);
    let path = s.path().trim_end_matches('/');
    if !path.is_empty()
        && let Ok(u) = EndpointUrl::parse(&format!(
            "{base}/.well-known/oauth-protected-resource{path}"
        ))
    {
        out.push(u);
    }
    if let Ok(u) = EndpointUrl::parse(&format!("{base}/.well-known/oauth-protected-resource")) {
        out.push(u);
    }
    out.dedup();
    out
}

/// Find and validate the protected-resource metadata of `server`.
pub async fn discover_resource(
    http: &ZoneClient,
    server: &EndpointUrl,
    challenge: Option<&Challenge>,
    pinned_resource: Option<&str>,
) -> Result<ResourceMetadata, OAuthError> {
    for url in resource_candidates(server, challenge) {
        let Some(doc) = get_json(http, &url).await? else {
            continue;
        };
        let resource = doc
            .get("resource")
            .and_then(Value::as_str)
            .ok_or(OAuthError::Malformed(
                "protected-resource metadata (no resource)",
            ))?
            .to_owned();
        if !resource_matches(server, &resource, pinned_resource) {
            return Err(OAuthError::ResourceMismatch);
        }
        let servers = strings(&doc, "authorization_servers");
        if servers.is_empty() {
            return Err(OAuthError::Malformed(
                "protected-resource metadata (no authorization_servers)",
            ));
        }
        return Ok(ResourceMetadata {
            resource,
            authorization_servers: servers,
            scopes_supported: scope_list(&doc, "scopes_supported"),
        });
    }
    Err(OAuthError::NoResourceMetadata)
}

/// The issuer of `listed` (a protected-resource metadata's `authorization_servers`) that the
/// operator pinned: the one spelled exactly like `pinned`. Issuers are identifiers compared as
/// strings (RFC 8414 §3.3), and a configured one is kept as written, so `https://as.example`
/// and `https://as.example/` are two issuers, never one.
pub fn pinned_issuer(listed: &[String], pinned: &str) -> Option<String> {
    listed.iter().find(|s| *s == pinned).cloned()
}

/// Candidate metadata URLs for an issuer, in the specified order.
pub fn server_candidates(issuer: &str) -> Result<Vec<EndpointUrl>, OAuthError> {
    let u = EndpointUrl::parse(issuer).map_err(|e| OAuthError::BadEndpoint {
        which: "issuer",
        host: host_of(issuer),
        why: e.to_string(),
    })?;
    let base = origin(u.as_url());
    let path = u.as_url().path().trim_end_matches('/');
    let list = if path.is_empty() {
        vec![
            format!("{base}/.well-known/oauth-authorization-server"),
            format!("{base}/.well-known/openid-configuration"),
        ]
    } else {
        vec![
            format!("{base}/.well-known/oauth-authorization-server{path}"),
            format!("{base}/.well-known/openid-configuration{path}"),
            format!("{base}{path}/.well-known/openid-configuration"),
        ]
    };
    Ok(list
        .iter()
        .filter_map(|s| EndpointUrl::parse(s).ok())
        .collect())
}

fn endpoint(doc: &Value, key: &'static str) -> Result<Option<EndpointUrl>, OAuthError> {
    match doc.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            EndpointUrl::parse(s)
                .map(Some)
                .map_err(|e| OAuthError::BadEndpoint {
                    which: key,
                    host: host_of(s),
                    why: e.to_string(),
                })
        }
        Some(_) => Err(OAuthError::Malformed("authorization-server metadata")),
    }
}

/// Validate one metadata document for `issuer` (exact issuer match, endpoint rules, PKCE S256,
/// the cross-origin authorization-endpoint rule).
pub fn validate_server(issuer: &str, doc: &Value) -> Result<ServerMetadata, OAuthError> {
    validate_server_for(issuer, doc, Purpose::AuthorizationCode)
}

/// Validate one metadata document for `issuer` and `purpose`.
pub fn validate_server_for(
    issuer: &str,
    doc: &Value,
    purpose: Purpose,
) -> Result<ServerMetadata, OAuthError> {
    if doc.get("issuer").and_then(Value::as_str) != Some(issuer) {
        return Err(OAuthError::IssuerMismatch);
    }
    let authorization_endpoint = endpoint(doc, "authorization_endpoint")?;
    let token_endpoint = endpoint(doc, "token_endpoint")?.ok_or(OAuthError::Malformed(
        "authorization-server metadata (no token_endpoint)",
    ))?;
    let iss_parameter_supported = doc
        .get("authorization_response_iss_parameter_supported")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if purpose == Purpose::AuthorizationCode {
        let Some(authorization_endpoint) = &authorization_endpoint else {
            return Err(OAuthError::Malformed(
                "authorization-server metadata (no authorization_endpoint)",
            ));
        };
        if !strings(doc, "code_challenge_methods_supported")
            .iter()
            .any(|m| m == "S256")
        {
            return Err(OAuthError::NoPkce);
        }
        let issuer_origin = url::Url::parse(issuer)
            .map(|u| origin(&u))
            .unwrap_or_default();
        let auth_origin = origin(authorization_endpoint.as_url());
        let same_origin =
            auth_origin == issuer_origin || auth_origin == origin(token_endpoint.as_url());
        if !same_origin && !iss_parameter_supported {
            return Err(OAuthError::BadEndpoint {
                which: "authorization_endpoint",
                host: host_of(authorization_endpoint.as_str()),
                why: "it is on another origin than the issuer and the token endpoint, and the \
                      server does not bind its responses to the issuer (RFC 9207)"
                    .into(),
            });
        }
    }
    Ok(ServerMetadata {
        issuer: issuer.to_owned(),
        authorization_endpoint,
        token_endpoint,
        registration_endpoint: endpoint(doc, "registration_endpoint")?,
        revocation_endpoint: endpoint(doc, "revocation_endpoint")?,
        token_endpoint_auth_methods: strings(doc, "token_endpoint_auth_methods_supported"),
        scopes_supported: scope_list(doc, "scopes_supported"),
        cimd_supported: doc
            .get("client_id_metadata_document_supported")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        iss_parameter_supported,
        grant_types_supported: strings(doc, "grant_types_supported")
            .into_iter()
            .take(MAX_LISTED_SCOPES)
            .collect(),
    })
}

/// Find and validate the metadata of `issuer` for the authorization-code flow.
pub async fn discover_server(
    http: &ZoneClient,
    issuer: &str,
) -> Result<ServerMetadata, OAuthError> {
    discover_server_for(http, issuer, Purpose::AuthorizationCode).await
}

/// Find and validate the metadata of `issuer` for `purpose`.
pub async fn discover_server_for(
    http: &ZoneClient,
    issuer: &str,
    purpose: Purpose,
) -> Result<ServerMetadata, OAuthError> {
    for url in server_candidates(issuer)? {
        if let Some(doc) = get_json(http, &url).await? {
            return validate_server_for(issuer, &doc, purpose);
        }
    }
    Err(OAuthError::NoServerMetadata)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn u(s: &str) -> EndpointUrl {
        EndpointUrl::parse(s).unwrap()
    }

    #[test]
    fn resource_identity_follows_the_product_rules() {
        let server = u("https://mcp.example.com/mcp?tenant=1");
        for ok in [
            "https://mcp.example.com/mcp",
            "https://mcp.example.com",
            "https://mcp.example.com/",
            "https://mcp.example.com/mcp?other=2",
        ] {
            assert!(resource_matches(&server, ok, None), "{ok}");
        }
        for bad in [
            "https://evil.example.com/mcp",
            "http://mcp.example.com/mcp",
            "https://mcp.example.com:8443/mcp",
            "https://mcp.example.com/other",
            "https://mcp.example.com/mc",
            "not a url",
        ] {
            assert!(!resource_matches(&server, bad, None), "{bad}");
        }
        assert!(resource_matches(
            &server,
            "https://x.example/r",
            Some("https://x.example/r")
        ));
        assert!(!resource_matches(
            &server,
            "https://mcp.example.com/mcp",
            Some("https://mcp.example.com/mcp/")
        ));
    }

    #[test]
    fn well_known_orders_match_the_specification() {
        let c = resource_candidates(
            &u("https://r.example/mcp"),
            Some(&Challenge {
                resource_metadata: Some("https://r.example/custom.json".into()),
                ..Challenge::default()
            }),
        );
        let got: Vec<&str> = c.iter().map(EndpointUrl::as_str).collect();
        assert_eq!(
            got,
            vec![
                "https://r.example/custom.json",
                "https://r.example/.well-known/oauth-protected-resource/mcp",
                "https://r.example/.well-known/oauth-protected-resource",
            ]
        );
        let got: Vec<String> = server_candidates("https://as.example/tenant1/")
            .unwrap()
            .iter()
            .map(|e| e.as_str().to_owned())
            .collect();
        assert_eq!(
            got,
            vec![
                "https://as.example/.well-known/oauth-authorization-server/tenant1",
                "https://as.example/.well-known/openid-configuration/tenant1",
                "https://as.example/tenant1/.well-known/openid-configuration",
            ]
        );
        let got: Vec<String> = server_candidates("https://as.example")
            .unwrap()
            .iter()
            .map(|e| e.as_str().to_owned())
            .collect();
        assert_eq!(
            got,
            vec![
                "https://as.example/.well-known/oauth-authorization-server",
                "https://as.example/.well-known/openid-configuration",
            ]
        );
    }

    #[test]
    fn a_pinned_issuer_matches_only_its_exact_spelling() {
        let listed = vec![
            "https://as.example".to_owned(),
            "https://other.example/tenant".to_owned(),
        ];
        for same in ["https://as.example", "https://other.example/tenant"] {
            assert_eq!(pinned_issuer(&listed, same).as_deref(), Some(same));
        }
        for other in [
            "https://as.example/",
            "https://AS.example",
            "https://as.example:443",
            "https://other.example/tenant/",
            "https://other.example",
            "https://as.example:8443",
            "http://as.example",
            "not a url",
        ] {
            assert_eq!(pinned_issuer(&listed, other), None, "{other}");
        }
    }

    #[test]
    fn server_metadata_is_validated() {
        let good = json!({
            "issuer": "https://as.example",
            "authorization_endpoint": "https://as.example/authorize",
            "token_endpoint": "https://as.example/token",
            "registration_endpoint": "https://as.example/register",
            "code_challenge_methods_supported": ["S256"],
        });
        validate_server("https://as.example", &good).unwrap();
        assert_eq!(
            validate_server("https://as.example/", &good),
            Err(OAuthError::IssuerMismatch)
        );
        let mut no_pkce = good.clone();
        no_pkce["code_challenge_methods_supported"] = json!(["plain"]);
        assert_eq!(
            validate_server("https://as.example", &no_pkce),
            Err(OAuthError::NoPkce)
        );
        let mut userinfo = good.clone();
        userinfo["token_endpoint"] = json!("https://u:p@as.example/token");
        assert!(matches!(
            validate_server("https://as.example", &userinfo),
            Err(OAuthError::BadEndpoint {
                which: "token_endpoint",
                ..
            })
        ));
        let mut plain = good.clone();
        plain["token_endpoint"] = json!("http://as.example/token");
        assert!(matches!(
            validate_server("https://as.example", &plain),
            Err(OAuthError::BadEndpoint { .. })
        ));
        let mut cross = good.clone();
        cross["authorization_endpoint"] = json!("https://login.other.example/authorize");
        assert!(matches!(
            validate_server("https://as.example", &cross),
            Err(OAuthError::BadEndpoint {
                which: "authorization_endpoint",
                ..
            })
        ));
        cross["authorization_response_iss_parameter_supported"] = json!(true);
        validate_server("https://as.example", &cross).unwrap();
    }
}
