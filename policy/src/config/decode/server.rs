//! Decoding one server: its transport, tool filter, policy and OAuth block (with the
//! combinations a grant needs).

use std::collections::BTreeMap;

use super::{
    Fields, HTTP_ONLY, Result2, SERVER_KEYS, STDIO_ONLY, array, capability_set, decode_sandbox,
    env_value, err, identifier_value, name_value, optional, parsed, string, string_list, url_value,
    value_err, wrong_type,
};
use crate::capability::{ServerPolicy, ToolFilter};
use crate::config::{
    AbsolutePath, ClientAuth, ClientId, Command, ConfigErrorKind, CredentialBackend, Grant,
    HttpServer, MAX_ARGS, MAX_ENV_NAMES, MAX_HEADERS, MAX_SCOPES, MAX_TOOL_NAMES, OAUTH_KEYS,
    OAuthConfig, Registration, Scope, ServerConfig, StdioServer, Transport, ValueError, check_arg,
};
use crate::json::{Node, Path, Pos, Value};
use crate::names::{HeaderName, ServerName, ToolName};

pub(super) fn decode_server(node: &Node, path: &Path) -> Result2<ServerConfig> {
    let f = Fields::new(node, path, SERVER_KEYS)?;
    let (name_node, name_path) = f.require("name")?;
    let name = parsed(|s| name_value(ServerName::parse(s)))(name_node, &name_path)?;
    let transport_word = match f.get("transport") {
        None => "stdio",
        Some((n, p)) => {
            let w = string(n, &p)?;
            if w != "stdio" && w != "http" {
                return Err(err(
                    &p,
                    n.pos,
                    ConfigErrorKind::UnknownWord {
                        allowed: &["stdio", "http"],
                    },
                ));
            }
            w
        }
    };
    let (foreign, transport_name): (&[&str], &'static str) = if transport_word == "http" {
        (STDIO_ONLY, "http")
    } else {
        (HTTP_ONLY, "stdio")
    };
    for m in f.members {
        if let Some(key) = foreign.iter().find(|k| **k == m.key) {
            return Err(err(
                &path.key(key),
                m.key_pos,
                ConfigErrorKind::NotForTransport {
                    key,
                    transport: transport_name,
                },
            ));
        }
    }
    let transport = if transport_word == "http" {
        let (url_node, url_path) = f.require("url")?;
        let url = parsed(url_value)(url_node, &url_path)?;
        let mut header_env = BTreeMap::new();
        if let Some((hn, hp)) = f.get("header_env") {
            let hf = Fields::new_any(hn, &hp)?;
            if hf.members.len() > MAX_HEADERS {
                return Err(err(
                    &hp,
                    hn.pos,
                    ConfigErrorKind::TooMany { max: MAX_HEADERS },
                ));
            }
            let mut first_pos: BTreeMap<HeaderName, Pos> = BTreeMap::new();
            for m in hf.members {
                let kp = hp.key(&m.key);
                let header = HeaderName::parse(&m.key).map_err(|e| {
                    err(&kp, m.key_pos, ConfigErrorKind::Value(ValueError::Name(e)))
                })?;
                if let Some(first) = first_pos.get(&header) {
                    return Err(err(
                        &kp,
                        m.key_pos,
                        ConfigErrorKind::Duplicate { first: *first },
                    ));
                }
                first_pos.insert(header.clone(), m.key_pos);
                let env = parsed(env_value)(&m.node, &kp)?;
                header_env.insert(header, env);
            }
        }
        let oauth = optional(&f, "oauth", decode_oauth)?;
        Transport::Http(HttpServer {
            url,
            header_env,
            oauth,
        })
    } else {
        let (cmd_node, cmd_path) = f.require("command")?;
        let command = parsed(Command::parse)(cmd_node, &cmd_path)?;
        let args = match f.get("args") {
            None => Vec::new(),
            Some((n, p)) => {
                let items = array(n, &p, MAX_ARGS)?;
                let mut args = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let ip = p.index(i);
                    let a = string(item, &ip)?;
                    check_arg(a).map_err(|e| value_err(&ip, item, e))?;
                    args.push(a.to_owned());
                }
                args
            }
        };
        let env = match f.get("env") {
            None => Vec::new(),
            Some((n, p)) => string_list(n, &p, MAX_ENV_NAMES, env_value)?,
        };
        let sandbox = optional(&f, "sandbox", decode_sandbox)?.unwrap_or_default();
        Transport::Stdio(StdioServer {
            command,
            args,
            env,
            sandbox,
        })
    };
    let tools = match f.get("tools") {
        None => ToolFilter::default(),
        Some((n, p)) => decode_filter(n, &p)?,
    };
    let policy = match f.get("policy") {
        None => ServerPolicy::default(),
        Some((n, p)) => decode_policy(n, &p)?,
    };
    Ok(ServerConfig {
        name,
        transport,
        tools,
        policy,
    })
}

impl<'a> Fields<'a> {
    /// An object whose keys are data (header names, tool names), not schema keys.
    pub(super) fn new_any(node: &'a Node, path: &Path) -> Result2<Self> {
        let Value::Object(members) = &node.value else {
            return Err(wrong_type(path, node, "an object"));
        };
        Ok(Fields {
            members,
            path: path.clone(),
            pos: node.pos,
        })
    }
}

fn tool_value(s: &str) -> Result<ToolName, ValueError> {
    name_value(ToolName::parse(s))
}

fn decode_filter(node: &Node, path: &Path) -> Result2<ToolFilter> {
    let f = Fields::new(node, path, &["allow", "deny"])?;
    let allow = match f.get("allow") {
        None => Vec::new(),
        Some((n, p)) => string_list(n, &p, MAX_TOOL_NAMES, tool_value)?,
    };
    let deny = match f.get("deny") {
        None => Vec::new(),
        Some((n, p)) => string_list(n, &p, MAX_TOOL_NAMES, tool_value)?,
    };
    if let Some((n, p)) = f.get("deny")
        && let Value::Array(items) = &n.value
    {
        for (i, t) in deny.iter().enumerate() {
            if allow.contains(t) {
                return Err(err(
                    &p.index(i),
                    items[i].pos,
                    ConfigErrorKind::AllowedAndDenied,
                ));
            }
        }
    }
    Ok(ToolFilter { allow, deny })
}

fn decode_policy(node: &Node, path: &Path) -> Result2<ServerPolicy> {
    let f = Fields::new(node, path, &["capabilities", "tools"])?;
    let capabilities = optional(&f, "capabilities", capability_set)?;
    let mut tools = BTreeMap::new();
    if let Some((tn, tp)) = f.get("tools") {
        let tf = Fields::new_any(tn, &tp)?;
        if tf.members.len() > MAX_TOOL_NAMES {
            return Err(err(
                &tp,
                tn.pos,
                ConfigErrorKind::TooMany {
                    max: MAX_TOOL_NAMES,
                },
            ));
        }
        for m in tf.members {
            let kp = tp.key(&m.key);
            let tool = ToolName::parse(&m.key)
                .map_err(|e| err(&kp, m.key_pos, ConfigErrorKind::Value(ValueError::Name(e))))?;
            tools.insert(tool, capability_set(&m.node, &kp)?);
        }
    }
    Ok(ServerPolicy {
        capabilities,
        tools,
    })
}

fn decode_oauth(node: &Node, path: &Path) -> Result2<OAuthConfig> {
    let f = Fields::new(node, path, OAUTH_KEYS)?;
    let env = |key| optional(&f, key, parsed(env_value));
    let url = |key| optional(&f, key, parsed(url_value));
    // Issuers and resources are identifiers, compared as strings: kept as written.
    let identifier = |key| optional(&f, key, parsed(identifier_value));
    let client_registration = optional(&f, "client_registration", |n, p| {
        Registration::parse(string(n, p)?).ok_or_else(|| {
            err(
                p,
                n.pos,
                ConfigErrorKind::UnknownWord {
                    allowed: &["auto", "cimd", "dcr"],
                },
            )
        })
    })?;
    let credential_store = optional(&f, "credential_store", |n, p| {
        CredentialBackend::parse(string(n, p)?).ok_or_else(|| {
            err(
                p,
                n.pos,
                ConfigErrorKind::UnknownWord {
                    allowed: &["file", "keyring"],
                },
            )
        })
    })?;
    let grant = optional(&f, "grant", |n, p| {
        Grant::parse(string(n, p)?).ok_or_else(|| {
            err(
                p,
                n.pos,
                ConfigErrorKind::UnknownWord {
                    allowed: Grant::WORDS,
                },
            )
        })
    })?;
    let token_endpoint_auth = optional(&f, "token_endpoint_auth", |n, p| {
        ClientAuth::parse(string(n, p)?).ok_or_else(|| {
            err(
                p,
                n.pos,
                ConfigErrorKind::UnknownWord {
                    allowed: ClientAuth::WORDS,
                },
            )
        })
    })?;
    let config = OAuthConfig {
        resource: identifier("resource")?,
        scopes: match f.get("scopes") {
            None => Vec::new(),
            Some((n, p)) => string_list(n, &p, MAX_SCOPES, Scope::parse)?,
        },
        client_registration,
        client_id: optional(&f, "client_id", parsed(ClientId::parse))?,
        client_secret_env: env("client_secret_env")?,
        issuer: identifier("issuer")?,
        access_token_env: env("access_token_env")?,
        expires_at_env: env("expires_at_env")?,
        refresh_url: url("refresh_url")?,
        refresh_token_env: env("refresh_token_env")?,
        revoke_url: url("revoke_url")?,
        credential_store,
        grant,
        token_endpoint_auth,
        client_key_file: optional(&f, "client_key_file", parsed(AbsolutePath::parse))?,
        client_key_env: env("client_key_env")?,
        identity_token_file: optional(&f, "identity_token_file", parsed(AbsolutePath::parse))?,
        identity_token_env: env("identity_token_env")?,
        dpop: optional(&f, "dpop", |n, p| match n.value {
            Value::Bool(b) => Ok(b),
            _ => Err(wrong_type(p, n, "true or false")),
        })?,
        idp_issuer: identifier("idp_issuer")?,
        idp_client_id: optional(&f, "idp_client_id", parsed(ClientId::parse))?,
        idp_client_secret_env: env("idp_client_secret_env")?,
    };
    check_oauth(&f, &config)?;
    Ok(config)
}

/// The rules that tie the keys of one `oauth` block together. Each refusal names the key it is
/// at and the key it needs or excludes.
fn check_oauth(f: &Fields<'_>, o: &OAuthConfig) -> Result2<()> {
    let refuse = |key: &str, why: &'static str| -> Result2<()> {
        let (node, path) = f
            .get(key)
            .map_or((None, f.path.clone()), |(n, p)| (Some(n), p));
        Err(err(
            &path,
            node.map_or(f.pos, |n| n.pos),
            ConfigErrorKind::Inconsistent(why),
        ))
    };
    // The externally managed token: its expiry, refresh and revocation belong to it.
    if o.access_token_env.is_none() {
        for key in [
            "expires_at_env",
            "refresh_url",
            "refresh_token_env",
            "revoke_url",
        ] {
            if f.get(key).is_some() {
                return refuse(
                    key,
                    "belongs to an externally managed token and needs access_token_env",
                );
            }
        }
    }
    match (&o.refresh_url, &o.refresh_token_env) {
        (Some(_), None) => {
            return refuse(
                "refresh_url",
                "needs refresh_token_env (the variable holding the refresh token to present)",
            );
        }
        (None, Some(_)) => {
            return refuse(
                "refresh_token_env",
                "needs refresh_url (where the refresh token is presented)",
            );
        }
        _ => {}
    }
    // The client's own credentials: a key from one place, matching the method named.
    if o.client_key_file.is_some() && o.client_key_env.is_some() {
        return refuse(
            "client_key_env",
            "excludes client_key_file (the key comes from one place)",
        );
    }
    let has_key = o.client_key_file.is_some() || o.client_key_env.is_some();
    match o.token_endpoint_auth {
        Some(ClientAuth::PrivateKeyJwt) if !has_key => {
            return refuse(
                "token_endpoint_auth",
                "private_key_jwt needs client_key_file or client_key_env",
            );
        }
        Some(ClientAuth::ClientSecretBasic | ClientAuth::ClientSecretPost)
            if o.client_secret_env.is_none() =>
        {
            return refuse(
                "token_endpoint_auth",
                "a client secret method needs client_secret_env",
            );
        }
        Some(ClientAuth::ClientSecretBasic | ClientAuth::ClientSecretPost) if has_key => {
            for key in ["client_key_file", "client_key_env"] {
                if f.get(key).is_some() {
                    return refuse(key, "is only used with token_endpoint_auth private_key_jwt");
                }
            }
        }
        _ => {}
    }
    if has_key && o.client_secret_env.is_some() && o.token_endpoint_auth.is_none() {
        return refuse(
            "client_secret_env",
            "is ambiguous beside a client key; name the method with token_endpoint_auth",
        );
    }
    if (has_key || o.token_endpoint_auth.is_some())
        && !matches!(o.client_id, Some(ClientId::Plain(_)))
    {
        let key = if f.get("token_endpoint_auth").is_some() {
            "token_endpoint_auth"
        } else if f.get("client_key_file").is_some() {
            "client_key_file"
        } else {
            "client_key_env"
        };
        return refuse(
            key,
            "needs a pre-registered client_id (not a metadata document URL)",
        );
    }
    if o.grant.is_some_and(Grant::is_noninteractive) {
        if o.access_token_env.is_some() {
            return refuse(
                "grant",
                "obtains tokens itself and excludes access_token_env (an externally managed token)",
            );
        }
        if f.get("client_registration").is_some() {
            return refuse(
                "client_registration",
                "applies to the authorization_code grant only (the other grants use a pre-registered client)",
            );
        }
        if o.issuer.is_none() {
            return refuse(
                "grant",
                "needs issuer (the client's credentials go only to the authorization server the operator pinned)",
            );
        }
    }
    if o.dpop == Some(true) && o.access_token_env.is_some() {
        return refuse(
            "dpop",
            "binds the tokens Iteron obtains and cannot bind access_token_env's (its key is not Iteron's)",
        );
    }
    // The workload's identity token: from one place, for the grant that presents it.
    let has_identity = o.identity_token_file.is_some() || o.identity_token_env.is_some();
    if o.identity_token_file.is_some() && o.identity_token_env.is_some() {
        return refuse(
            "identity_token_env",
            "excludes identity_token_file (the identity token comes from one place)",
        );
    }
    let presents_identity = matches!(o.grant, Some(Grant::JwtBearer | Grant::IdJag));
    if has_identity && !presents_identity {
        let key = if f.get("identity_token_file").is_some() {
            "identity_token_file"
        } else {
            "identity_token_env"
        };
        return refuse(key, "is only used with grant jwt_bearer or id_jag");
    }
    if presents_identity {
        if !has_identity {
            return refuse(
                "grant",
                "jwt_bearer and id_jag need identity_token_file or identity_token_env",
            );
        }
        if matches!(o.client_id, Some(ClientId::Document(_))) {
            return refuse(
                "client_id",
                "jwt_bearer and id_jag take a pre-registered client_id (not a metadata document URL)",
            );
        }
    }
    // The enterprise identity provider belongs to id_jag, and id_jag needs all of it.
    if o.grant != Some(Grant::IdJag) {
        for key in ["idp_issuer", "idp_client_id", "idp_client_secret_env"] {
            if f.get(key).is_some() {
                return refuse(key, "is only used with grant id_jag");
            }
        }
    } else {
        if o.idp_issuer.is_none() {
            return refuse(
                "grant",
                "id_jag needs idp_issuer (the enterprise identity provider)",
            );
        }
        if !matches!(o.idp_client_id, Some(ClientId::Plain(_))) {
            return refuse(
                "grant",
                "id_jag needs idp_client_id (Iteron's pre-registered client at the identity provider)",
            );
        }
        if !matches!(o.client_id, Some(ClientId::Plain(_))) {
            return refuse(
                "grant",
                "id_jag needs client_id (the client the authorization server knows)",
            );
        }
    }
    if o.grant == Some(Grant::ClientCredentials) {
        if !matches!(o.client_id, Some(ClientId::Plain(_))) {
            return refuse(
                "grant",
                "client_credentials needs a pre-registered client_id (not a metadata document URL)",
            );
        }
        if !has_key && o.client_secret_env.is_none() {
            return refuse(
                "grant",
                "client_credentials needs client_secret_env, client_key_file or client_key_env",
            );
        }
    }
    if o.client_id.is_none() {
        for key in ["refresh_url", "revoke_url"] {
            if f.get(key).is_some() {
                return refuse(
                    key,
                    "needs client_id (the client the externally managed token was issued to)",
                );
            }
        }
    }
    Ok(())
}
