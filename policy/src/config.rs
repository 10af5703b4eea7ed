//! The operator configuration, `schema_version: 2`.
//!
//! The file is the operator's statement of authority, so it is read strictly: unknown keys,
//! duplicate keys, values of the wrong type, names outside their grammar, unsafe URLs and
//! deceptive Unicode are all errors, each naming the JSON path and the line and column. Any
//! `schema_version` other than [`SCHEMA_VERSION`] is refused by name. Every list and string has an
//! explicit bound. Secrets never live here: headers and OAuth material are *named* by environment
//! variable, and error texts never quote a value from the file.

use std::collections::BTreeMap;
use std::fmt;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use crate::capability::{Capability, CapabilitySet, ServerPolicy, ToolFilter};
use crate::egress::{EgressRule, EgressRuleError, MAX_EGRESS_RULES};
use crate::json::{self, Member, Node, Path, Pos, SyntaxError, Value};
use crate::names::{EnvName, HeaderName, NameError, RuleId, ServerName, ToolName};
use crate::rules::{
    ApprovalsConfig, Constraint, DEFERRED_SECS_RANGE, Effect, Expiry, MAX_ARGUMENT_NAME,
    MAX_CALLS_RANGE, MAX_ONE_OF, MAX_RULE_ARGUMENTS, MAX_RULE_IDENTITIES, MAX_RULE_UIDS, MAX_RULES,
    MAX_UID, Rule, RuleTool, Scalar, Sha256Hex,
};
use crate::text::{self, UnsafeChar};
use crate::url::{EndpointUrl, IdentifierUrl, UrlError};

/// The only configuration schema this build reads and writes.
pub const SCHEMA_VERSION: u32 = 2;
/// Largest configuration file read or written, in bytes.
pub const MAX_CONFIG_BYTES: usize = 1024 * 1024;
/// Most servers in one configuration.
pub const MAX_SERVERS: usize = 512;
/// Most arguments of one stdio server.
pub const MAX_ARGS: usize = 256;
/// Most environment variable names forwarded to one stdio server.
pub const MAX_ENV_NAMES: usize = 128;
/// Most configured headers of one HTTP server.
pub const MAX_HEADERS: usize = 64;
/// Most tool names in one `tools.allow`, `tools.deny` or `policy.tools`.
pub const MAX_TOOL_NAMES: usize = 1000;
/// Most OAuth scopes.
pub const MAX_SCOPES: usize = 64;
/// Most hook commands for one event.
pub const MAX_HOOKS_PER_EVENT: usize = 16;
/// Longest string value (commands, arguments, client ids), in bytes.
pub const MAX_STRING_BYTES: usize = 4096;
/// Longest OAuth scope or client id, in bytes.
pub const MAX_TOKEN_BYTES: usize = 256;

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Config {
    /// Classes this host allows; `None` means [`CapabilitySet::DEFAULT_HOST_CEILING`].
    pub host_ceiling: Option<CapabilitySet>,
    /// Configured MCP servers, in file order, with unique (case-folded) names.
    pub mcp_servers: Vec<ServerConfig>,
    /// Lifecycle hooks by event.
    pub hooks: BTreeMap<HookEvent, Vec<AbsolutePath>>,
    /// Directories (or files) hooks may write, beyond their private scratch directory.
    pub hooks_writable: Vec<AbsolutePath>,
    /// Who hooks run as under a root broker; `None` is [`RunAs::Nobody`].
    pub hooks_run_as: Option<RunAs>,
    /// DNS and TLS settings of the broker's HTTP client.
    pub network: NetworkConfig,
    /// Approval rules and deferred approval (see [`crate::rules`]).
    pub approvals: ApprovalsConfig,
}

/// Most operator-named DNS servers.
pub const MAX_NAMESERVERS: usize = 8;

/// The `network` block: where DNS questions go and which extra CA the HTTP client trusts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NetworkConfig {
    /// DNS servers to ask instead of the system's `resolv.conf` (and then the hosts file is not
    /// consulted either). Empty = the system configuration.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<Nameserver>,
    /// A PEM bundle of extra root certificates, added to the built-in web PKI roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<AbsolutePath>,
}

impl NetworkConfig {
    /// Whether the block says nothing.
    pub fn is_empty(&self) -> bool {
        self.nameservers.is_empty() && self.ca_bundle.is_none()
    }
}

/// A DNS server address: `IP` (port 53) or `IP:port` / `[IPv6]:port`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nameserver(pub std::net::SocketAddr);

impl Nameserver {
    /// Validate: an IP address with an optional non-zero port; not unspecified or multicast.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        use std::net::{IpAddr, SocketAddr};
        let addr = match s.parse::<SocketAddr>() {
            Ok(a) => a,
            Err(_) => match s.parse::<IpAddr>() {
                Ok(ip) => SocketAddr::new(ip, 53),
                Err(_) => return Err(ValueError::BadNameserver),
            },
        };
        if addr.port() == 0 || addr.ip().is_unspecified() || addr.ip().is_multicast() {
            return Err(ValueError::BadNameserver);
        }
        Ok(Nameserver(addr))
    }
}

impl Serialize for Nameserver {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

/// One MCP server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServerConfig {
    /// The server's name.
    pub name: ServerName,
    /// How to reach it.
    #[serde(flatten)]
    pub transport: Transport,
    /// Exact-name tool filter.
    #[serde(skip_serializing_if = "ToolFilter::is_empty")]
    pub tools: ToolFilter,
    /// Capability bounds.
    #[serde(skip_serializing_if = "ServerPolicy::is_empty")]
    pub policy: ServerPolicy,
}

/// The transport of a server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "transport", rename_all = "lowercase")]
#[expect(
    clippy::large_enum_variant,
    reason = "at most MAX_SERVERS entries exist; boxing would buy nothing measurable"
)]
pub enum Transport {
    /// A supervised child process speaking JSON lines on stdin/stdout.
    Stdio(StdioServer),
    /// Streamable HTTP.
    Http(HttpServer),
}

impl Transport {
    /// `"stdio"` or `"http"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Transport::Stdio(_) => "stdio",
            Transport::Http(_) => "http",
        }
    }
}

/// A stdio server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StdioServer {
    /// The program.
    pub command: Command,
    /// Its arguments.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Names of the broker's environment variables forwarded to the child; only names are stored.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvName>,
    /// What the confined child may touch beyond the defaults.
    #[serde(skip_serializing_if = "Sandbox::is_empty")]
    pub sandbox: Sandbox,
}

/// Most paths in `sandbox.readable` or `sandbox.writable`.
pub const MAX_SANDBOX_PATHS: usize = 32;
/// Bounds of `sandbox.max_open_files`.
pub const OPEN_FILES_RANGE: (u64, u64) = (16, 1 << 20);
/// Bounds of `sandbox.max_memory_mb`.
pub const MEMORY_MB_RANGE: (u64, u64) = (64, 1 << 20);
/// Bounds of `sandbox.max_processes`.
pub const PROCESSES_RANGE: (u64, u64) = (1, 1 << 22);

/// The `sandbox` block of a stdio server: grants and limits for its confinement.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Sandbox {
    /// Extra directories (or files) it may read and execute from.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub readable: Vec<AbsolutePath>,
    /// Directories (or files) it may read and write.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub writable: Vec<AbsolutePath>,
    /// `RLIMIT_NOFILE`; `None` is the broker's default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_open_files: Option<u64>,
    /// `RLIMIT_DATA` in MiB; `None` is the broker's default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory_mb: Option<u64>,
    /// `RLIMIT_NPROC`; `None` sets none (the kernel counts every process of the uid, so only
    /// the operator can choose a number that fits the machine).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_processes: Option<u64>,
    /// Who the child runs as under a root broker; `None` is [`RunAs::Nobody`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_as: Option<RunAs>,
    /// Where a server admitted `web_egress` connects; `None` is
    /// [`SandboxNetwork::Namespace`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<SandboxNetwork>,
    /// Destinations above the public zone its egress path may reach (at most
    /// [`crate::egress::MAX_EGRESS_RULES`]; see [`crate::egress`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<EgressRule>,
}

/// The network of a confined stdio server (`sandbox.network`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxNetwork {
    /// Its own network namespace; with `web_egress`, its connections leave only through the
    /// broker's egress path, judged by the zone rules (the default).
    #[default]
    Namespace,
    /// The network as the host sees it (with `web_egress`): unconfined, shown as such.
    Host,
}

impl SandboxNetwork {
    /// Parse `namespace` or `host`.
    pub fn parse(s: &str) -> Result<SandboxNetwork, ValueError> {
        match s {
            "namespace" => Ok(SandboxNetwork::Namespace),
            "host" => Ok(SandboxNetwork::Host),
            _ => Err(ValueError::BadSandboxNetwork),
        }
    }
}

/// The largest uid or gid `run_as` accepts: `(uid_t)-1` means "no change" to the kernel.
pub const MAX_RUN_AS_ID: u32 = u32::MAX - 1;
/// The uid and gid of `nobody`.
pub const NOBODY_ID: u32 = 65534;

/// Who a confined child runs as when the broker runs as root (`sandbox.run_as`,
/// `hooks_run_as`). A broker that is not root cannot change uid: its children keep its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RunAs {
    /// uid and gid 65534 with no supplementary groups (the default).
    #[default]
    Nobody,
    /// The broker's own uid and groups (root): root-only files stay readable.
    Root,
    /// This uid and gid (a dedicated account), with no supplementary groups; neither 0.
    Ids {
        /// The uid.
        uid: u32,
        /// The gid.
        gid: u32,
    },
}

impl RunAs {
    /// Parse `nobody`, `root` or `UID:GID` (decimal, each 1 to [`MAX_RUN_AS_ID`]).
    pub fn parse(s: &str) -> Result<RunAs, ValueError> {
        match s {
            "nobody" => return Ok(RunAs::Nobody),
            "root" => return Ok(RunAs::Root),
            _ => {}
        }
        let id = |t: &str| -> Option<u32> {
            if t.is_empty() || t.len() > 10 || !t.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            t.parse::<u32>()
                .ok()
                .filter(|n| (1..=MAX_RUN_AS_ID).contains(n))
        };
        match s.split_once(':') {
            Some((u, g)) => match (id(u), id(g)) {
                (Some(uid), Some(gid)) => Ok(RunAs::Ids { uid, gid }),
                _ => Err(ValueError::BadRunAs),
            },
            None => Err(ValueError::BadRunAs),
        }
    }

    /// The configuration word.
    pub fn word(&self) -> String {
        match self {
            RunAs::Nobody => "nobody".into(),
            RunAs::Root => "root".into(),
            RunAs::Ids { uid, gid } => format!("{uid}:{gid}"),
        }
    }
}

impl Serialize for RunAs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.word())
    }
}

impl Sandbox {
    /// Nothing beyond the defaults.
    pub fn is_empty(&self) -> bool {
        *self == Sandbox::default()
    }
}

/// A Streamable HTTP server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HttpServer {
    /// The MCP endpoint.
    pub url: EndpointUrl,
    /// Header name → name of the environment variable holding its value.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub header_env: BTreeMap<HeaderName, EnvName>,
    /// OAuth settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oauth: Option<OAuthConfig>,
}

/// How the OAuth client is registered with the authorization server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Registration {
    /// Pre-registered client if configured, else CIMD if offered, else DCR.
    Auto,
    /// Client ID metadata document only.
    Cimd,
    /// Dynamic client registration only.
    Dcr,
}

impl Registration {
    /// Parse `auto`, `cimd` or `dcr`.
    pub fn parse(s: &str) -> Option<Registration> {
        match s {
            "auto" => Some(Registration::Auto),
            "cimd" => Some(Registration::Cimd),
            "dcr" => Some(Registration::Dcr),
            _ => None,
        }
    }
}

/// Where the secret part of an OAuth login (tokens, a registered client's secret) is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CredentialBackend {
    /// A 0600 file under `mcp-credentials/` (the default).
    File,
    /// The operating system keyring (Secret Service on Linux); never falls back to a file.
    Keyring,
}

impl CredentialBackend {
    /// Parse `file` or `keyring`.
    pub fn parse(s: &str) -> Option<CredentialBackend> {
        match s {
            "file" => Some(CredentialBackend::File),
            "keyring" => Some(CredentialBackend::Keyring),
            _ => None,
        }
    }

    /// The configuration word.
    pub fn as_str(self) -> &'static str {
        match self {
            CredentialBackend::File => "file",
            CredentialBackend::Keyring => "keyring",
        }
    }
}

/// How Iteron obtains tokens for an HTTP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Grant {
    /// The operator logs in through a browser (the default).
    AuthorizationCode,
    /// The client's own credentials (RFC 6749 §4.4): no browser, no user.
    ClientCredentials,
    /// A workload identity token presented as an RFC 7523 JWT-bearer grant.
    JwtBearer,
    /// Enterprise-managed authorization: the user's ID token from the enterprise identity
    /// provider exchanged there for an ID-JAG (RFC 8693), presented to the authorization
    /// server as a JWT-bearer grant.
    IdJag,
}

impl Grant {
    /// Every grant, in configuration order.
    pub const ALL: [Grant; 4] = [
        Grant::AuthorizationCode,
        Grant::ClientCredentials,
        Grant::JwtBearer,
        Grant::IdJag,
    ];
    const WORDS: &'static [&'static str] = &[
        "authorization_code",
        "client_credentials",
        "jwt_bearer",
        "id_jag",
    ];

    /// The configuration word.
    pub fn as_str(self) -> &'static str {
        Self::WORDS[self as usize]
    }

    /// Parse the configuration word.
    pub fn parse(s: &str) -> Option<Grant> {
        Grant::ALL.into_iter().find(|g| g.as_str() == s)
    }

    /// Whether tokens are obtained without a browser (the broker can renew them itself).
    pub fn is_noninteractive(self) -> bool {
        self != Grant::AuthorizationCode
    }
}

/// How a pre-registered confidential client authenticates at the token endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    /// The client secret in HTTP Basic.
    ClientSecretBasic,
    /// The client secret in the form body.
    ClientSecretPost,
    /// An RFC 7523 assertion signed with the client's private key.
    PrivateKeyJwt,
}

impl ClientAuth {
    const ALL: [ClientAuth; 3] = [
        ClientAuth::ClientSecretBasic,
        ClientAuth::ClientSecretPost,
        ClientAuth::PrivateKeyJwt,
    ];
    const WORDS: &'static [&'static str] = &[
        "client_secret_basic",
        "client_secret_post",
        "private_key_jwt",
    ];

    /// The configuration (RFC 7591) word.
    pub fn as_str(self) -> &'static str {
        Self::WORDS[self as usize]
    }

    /// Parse the configuration word.
    pub fn parse(s: &str) -> Option<ClientAuth> {
        ClientAuth::ALL.into_iter().find(|a| a.as_str() == s)
    }
}

/// OAuth settings of an HTTP server. Values that are secrets are named by environment variable.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OAuthConfig {
    /// The protected resource to bind, when it differs from what discovery would choose.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource: Option<IdentifierUrl>,
    /// Scopes requested at login (the operator's choice is never edited).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<Scope>,
    /// Registration mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_registration: Option<Registration>,
    /// A pre-registered client id, or a CIMD URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<ClientId>,
    /// Variable holding the pre-registered client secret.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_secret_env: Option<EnvName>,
    /// The authorization server issuer to pin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub issuer: Option<IdentifierUrl>,
    /// Variable holding an externally managed access token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_token_env: Option<EnvName>,
    /// Variable holding that token's expiry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at_env: Option<EnvName>,
    /// Token endpoint used to refresh an external token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refresh_url: Option<EndpointUrl>,
    /// Variable holding the refresh token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refresh_token_env: Option<EnvName>,
    /// Revocation endpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoke_url: Option<EndpointUrl>,
    /// Where the login's secrets are kept (`file` when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_store: Option<CredentialBackend>,
    /// How tokens are obtained (`authorization_code` when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grant: Option<Grant>,
    /// How the pre-registered client authenticates (chosen from the key or secret when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_endpoint_auth: Option<ClientAuth>,
    /// File holding the client's private key (PKCS#8 PEM), for `private_key_jwt`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_key_file: Option<AbsolutePath>,
    /// Variable (or `$CREDENTIALS_DIRECTORY` credential) holding that key instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_key_env: Option<EnvName>,
    /// File holding the workload's identity token (`jwt_bearer`), read at every exchange.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity_token_file: Option<AbsolutePath>,
    /// Variable (or `$CREDENTIALS_DIRECTORY` credential) holding it instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity_token_env: Option<EnvName>,
    /// Ask for DPoP-bound (sender-constrained) tokens (RFC 9449).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dpop: Option<bool>,
    /// The enterprise identity provider (`id_jag`): its issuer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idp_issuer: Option<IdentifierUrl>,
    /// Iteron's client id at that identity provider.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idp_client_id: Option<ClientId>,
    /// Variable holding that client's secret, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idp_client_secret_env: Option<EnvName>,
}

/// Keys of the `oauth` block, in serialization order.
const OAUTH_KEYS: &[&str] = &[
    "resource",
    "scopes",
    "client_registration",
    "client_id",
    "client_secret_env",
    "issuer",
    "access_token_env",
    "expires_at_env",
    "refresh_url",
    "refresh_token_env",
    "revoke_url",
    "credential_store",
    "grant",
    "token_endpoint_auth",
    "client_key_file",
    "client_key_env",
    "identity_token_file",
    "identity_token_env",
    "dpop",
    "idp_issuer",
    "idp_client_id",
    "idp_client_secret_env",
];

/// A lifecycle hook event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum HookEvent {
    /// A session opened.
    SessionStart,
    /// The user submitted a prompt.
    UserPromptSubmit,
    /// Before an effect; exit code 2 blocks it.
    PreToolUse,
    /// After an effect.
    PostToolUse,
    /// The session ended.
    Stop,
}

impl HookEvent {
    /// Every event, in order.
    pub const ALL: [HookEvent; 5] = [
        HookEvent::SessionStart,
        HookEvent::UserPromptSubmit,
        HookEvent::PreToolUse,
        HookEvent::PostToolUse,
        HookEvent::Stop,
    ];
    const NAMES: &'static [&'static str] = &[
        "SessionStart",
        "UserPromptSubmit",
        "PreToolUse",
        "PostToolUse",
        "Stop",
    ];

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Parse the exact spelling.
    pub fn parse(s: &str) -> Option<HookEvent> {
        HookEvent::ALL.into_iter().find(|e| e.as_str() == s)
    }
}

/// An absolute path without NUL, `.`/`..` components or unsafe characters, at most
/// [`MAX_STRING_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct AbsolutePath(String);

impl AbsolutePath {
    /// Validate.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        check_text(s, MAX_STRING_BYTES)?;
        if !s.starts_with('/') {
            return Err(ValueError::NotAbsolute);
        }
        if s.split('/').any(|c| c == "." || c == "..") {
            return Err(ValueError::DotComponent);
        }
        Ok(AbsolutePath(s.to_owned()))
    }

    /// The path.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A stdio server's program: an absolute path, or a bare program name looked up on the broker's
/// fixed safe `PATH` at spawn time. Relative paths with a `/` are refused: they would depend on
/// the working directory of whoever starts the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Command(String);

impl Command {
    /// Validate.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        if s.chars().any(char::is_whitespace) {
            // A command is one program; `/usr/bin/env TOKEN=… server` is not a command.
            return Err(ValueError::Whitespace);
        }
        if s.starts_with('/') {
            return AbsolutePath::parse(s).map(|p| Command(p.0));
        }
        check_text(s, MAX_STRING_BYTES)?;
        let bare = s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b));
        if !bare || s.starts_with('.') || s.starts_with('-') {
            return Err(ValueError::NotAbsolute);
        }
        Ok(Command(s.to_owned()))
    }

    /// The command text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An OAuth scope token (RFC 6749 §3.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Scope(String);

impl Scope {
    /// Validate.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        if s.is_empty() {
            return Err(ValueError::Empty);
        }
        if s.len() > MAX_TOKEN_BYTES {
            return Err(ValueError::TooLong {
                max: MAX_TOKEN_BYTES,
            });
        }
        let ok = s
            .bytes()
            .all(|b| b == 0x21 || (0x23..=0x5b).contains(&b) || (0x5d..=0x7e).contains(&b));
        if !ok {
            return Err(ValueError::BadScope);
        }
        Ok(Scope(s.to_owned()))
    }

    /// The scope.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An OAuth client id: a plain identifier, or a client ID metadata document URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientId {
    /// A pre-registered identifier (printable ASCII, no spaces).
    Plain(String),
    /// A CIMD URL.
    Document(EndpointUrl),
}

impl ClientId {
    /// Validate: anything containing `://` must be an endpoint URL.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        if s.contains("://") {
            return EndpointUrl::parse(s)
                .map(ClientId::Document)
                .map_err(ValueError::Url);
        }
        if s.is_empty() {
            return Err(ValueError::Empty);
        }
        if s.len() > MAX_TOKEN_BYTES {
            return Err(ValueError::TooLong {
                max: MAX_TOKEN_BYTES,
            });
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ValueError::BadClientId);
        }
        Ok(ClientId::Plain(s.to_owned()))
    }

    /// The id as configured.
    pub fn as_str(&self) -> &str {
        match self {
            ClientId::Plain(s) => s,
            ClientId::Document(u) => u.as_str(),
        }
    }
}

impl Serialize for ClientId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Why a single value was refused (shared by the file reader and the command line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueError {
    /// Empty where a value is required.
    Empty,
    /// Over the byte bound.
    TooLong {
        /// The bound.
        max: usize,
    },
    /// Contains a NUL byte.
    Nul,
    /// Contains a character unsafe to display (bidi control, invisible, control, …).
    Unsafe(UnsafeChar),
    /// A path that must be absolute is not (or a command that is neither absolute nor bare).
    NotAbsolute,
    /// A path with a `.` or `..` component.
    DotComponent,
    /// Not an OAuth scope token.
    BadScope,
    /// A client id with spaces or non-printable characters.
    BadClientId,
    /// A name outside its grammar.
    Name(NameError),
    /// A URL that breaks the endpoint rules.
    Url(UrlError),
    /// Not `IP`, `IP:port` or `[IPv6]:port`, or an unspecified/multicast address or port 0.
    BadNameserver,
    /// Whitespace where one program path is expected.
    Whitespace,
    /// Not `nobody`, `root` or `UID:GID` within bounds.
    BadRunAs,
    /// Not 64 lowercase hex digits.
    BadDigest,
    /// Not a `YYYY-MM-DDTHH:MM:SSZ` time from 1970 on.
    BadTime,
    /// Not `namespace` or `host`.
    BadSandboxNetwork,
    /// Not a `sandbox.egress` entry.
    Egress(EgressRuleError),
}

impl fmt::Display for ValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueError::Empty => f.write_str("is empty"),
            ValueError::TooLong { max } => write!(f, "is longer than {max} bytes"),
            ValueError::Nul => f.write_str("contains a NUL character"),
            ValueError::Unsafe(u) => write!(f, "contains {u}"),
            ValueError::NotAbsolute => {
                f.write_str("must be an absolute path (or, for a command, a bare program name)")
            }
            ValueError::DotComponent => f.write_str("must not contain '.' or '..' components"),
            ValueError::BadScope => f.write_str("is not an OAuth scope token"),
            ValueError::BadClientId => {
                f.write_str("must be printable ASCII without spaces, or an https URL")
            }
            ValueError::Name(e) => e.fmt(f),
            ValueError::Url(e) => e.fmt(f),
            ValueError::Whitespace => f.write_str(
                "must be a single program without spaces; put arguments after -- (or in \"args\")",
            ),
            ValueError::BadNameserver => f.write_str(
                "must be IP, IP:port or [IPv6]:port (not unspecified, multicast or port 0)",
            ),
            ValueError::BadRunAs => write!(
                f,
                "must be \"nobody\", \"root\" or UID:GID (decimal, each 1 to {MAX_RUN_AS_ID})"
            ),
            ValueError::BadDigest => f.write_str("must be a SHA-256 in 64 lowercase hex digits"),
            ValueError::BadTime => {
                f.write_str("must be a UTC time written YYYY-MM-DDTHH:MM:SSZ (1970 or later)")
            }
            ValueError::BadSandboxNetwork => f.write_str("must be \"namespace\" or \"host\""),
            ValueError::Egress(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ValueError {}

fn check_text(s: &str, max: usize) -> Result<(), ValueError> {
    if s.is_empty() {
        return Err(ValueError::Empty);
    }
    if s.len() > max {
        return Err(ValueError::TooLong { max });
    }
    if s.contains('\0') {
        return Err(ValueError::Nul);
    }
    text::check_untrusted(s, false).map_err(ValueError::Unsafe)
}

/// Validate one stdio argument: at most [`MAX_STRING_BYTES`], no NUL, nothing unsafe to display.
/// Empty arguments are legal.
pub fn check_arg(s: &str) -> Result<(), ValueError> {
    if s.is_empty() {
        return Ok(());
    }
    check_text(s, MAX_STRING_BYTES)
}

/// What was wrong with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// The file is larger than [`MAX_CONFIG_BYTES`].
    TooLarge,
    /// Not well-formed JSON (or a duplicate key).
    Syntax(SyntaxError),
    /// `schema_version` is missing, not an integer, or not [`SCHEMA_VERSION`].
    SchemaVersion {
        /// The integer found, when it was one.
        found: Option<u64>,
    },
    /// A key this schema does not define.
    UnknownKey {
        /// The key, escaped for display.
        key: String,
        /// The keys allowed here.
        allowed: &'static [&'static str],
    },
    /// A key that must be present.
    MissingKey(&'static str),
    /// A value of the wrong JSON type.
    WrongType {
        /// What the schema wants.
        expected: &'static str,
        /// What the file has.
        found: &'static str,
    },
    /// A list longer than its bound.
    TooMany {
        /// The bound.
        max: usize,
    },
    /// The same item twice in a list, or two servers whose names fold alike.
    Duplicate {
        /// Where the first one is.
        first: Pos,
    },
    /// A value outside the allowed set of words.
    UnknownWord {
        /// The allowed words.
        allowed: &'static [&'static str],
    },
    /// A key that does not belong to this server's transport.
    NotForTransport {
        /// The key.
        key: &'static str,
        /// The server's transport.
        transport: &'static str,
    },
    /// A tool named in both `tools.allow` and `tools.deny`.
    AllowedAndDenied,
    /// An integer outside its bounds (or not a non-negative integer).
    OutOfRange {
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// A single value was refused.
    Value(ValueError),
    /// A key that only makes sense together with another one, or that excludes another one
    /// (fixed text naming both).
    Inconsistent(&'static str),
    /// An object that must have exactly one of these keys (an argument constraint).
    ExactlyOne {
        /// The keys, one of which must be given.
        allowed: &'static [&'static str],
    },
    /// A range whose `min` is greater than its `max`.
    RangeInverted,
    /// A key that only an allow rule may have.
    NotForDeny {
        /// The key.
        key: &'static str,
    },
}

/// A configuration error: where, and what. Its `Display` is one line and never quotes a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The JSON path.
    pub path: Path,
    /// The line and column.
    pub pos: Pos,
    /// What was wrong.
    pub kind: ConfigErrorKind,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.path, self.pos, self.kind)
    }
}

impl fmt::Display for ConfigErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigErrorKind::TooLarge => {
                write!(f, "configuration is larger than {MAX_CONFIG_BYTES} bytes")
            }
            ConfigErrorKind::Syntax(e) => e.fmt(f),
            ConfigErrorKind::SchemaVersion { found: Some(v) } => write!(
                f,
                "unsupported schema_version {v}; this iteron reads schema_version {SCHEMA_VERSION}"
            ),
            ConfigErrorKind::SchemaVersion { found: None } => write!(
                f,
                "schema_version must be the integer {SCHEMA_VERSION} (the only supported version)"
            ),
            ConfigErrorKind::UnknownKey { key, allowed } => {
                write!(f, "unknown key \"{key}\" (allowed: {})", allowed.join(", "))
            }
            ConfigErrorKind::MissingKey(k) => write!(f, "missing required key \"{k}\""),
            ConfigErrorKind::WrongType { expected, found } => {
                write!(f, "expected {expected}, found {found}")
            }
            ConfigErrorKind::TooMany { max } => write!(f, "more than {max} entries"),
            ConfigErrorKind::Duplicate { first } => {
                write!(f, "duplicate entry (first at {first})")
            }
            ConfigErrorKind::UnknownWord { allowed } => {
                write!(f, "must be one of: {}", allowed.join(", "))
            }
            ConfigErrorKind::NotForTransport { key, transport } => {
                write!(f, "\"{key}\" is not valid for a {transport} server")?;
                if *key == "url" {
                    f.write_str(" (set \"transport\": \"http\")")?;
                }
                Ok(())
            }
            ConfigErrorKind::AllowedAndDenied => {
                f.write_str("tool is listed in both tools.allow and tools.deny")
            }
            ConfigErrorKind::OutOfRange { min, max } => {
                write!(f, "must be an integer from {min} to {max}")
            }
            ConfigErrorKind::Value(e) => e.fmt(f),
            ConfigErrorKind::Inconsistent(why) => f.write_str(why),
            ConfigErrorKind::ExactlyOne { allowed } => {
                write!(f, "must have exactly one of: {}", allowed.join(", "))
            }
            ConfigErrorKind::RangeInverted => f.write_str("min is greater than max"),
            ConfigErrorKind::NotForDeny { key } => {
                write!(
                    f,
                    "\"{key}\" is for allow rules only (a deny rule counts nothing)"
                )
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Why a server could not be added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddError {
    /// A server with this name (compared case-insensitively) exists.
    Exists(ServerName),
    /// The configuration already holds [`MAX_SERVERS`].
    Full,
}

impl fmt::Display for AddError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddError::Exists(n) => write!(f, "a server named {n} already exists"),
            AddError::Full => write!(f, "the configuration already holds {MAX_SERVERS} servers"),
        }
    }
}

impl std::error::Error for AddError {}

impl Config {
    /// Parse a configuration file's bytes.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.len() > MAX_CONFIG_BYTES {
            return Err(ConfigError {
                path: Path::root(),
                pos: Pos { line: 1, column: 1 },
                kind: ConfigErrorKind::TooLarge,
            });
        }
        let root = json::parse(bytes).map_err(|e| ConfigError {
            path: e.path,
            pos: e.pos,
            kind: ConfigErrorKind::Syntax(e.kind),
        })?;
        decode_config(&root)
    }

    /// The host ceiling in force.
    pub fn ceiling(&self) -> CapabilitySet {
        self.host_ceiling
            .unwrap_or(CapabilitySet::DEFAULT_HOST_CEILING)
    }

    /// The server with exactly this name.
    pub fn server(&self, name: &str) -> Option<&ServerConfig> {
        self.mcp_servers.iter().find(|s| s.name.as_str() == name)
    }

    /// Add a server; refuses a name that folds like an existing one.
    pub fn add_server(&mut self, server: ServerConfig) -> Result<(), AddError> {
        let folded = server.name.folded();
        if let Some(existing) = self.mcp_servers.iter().find(|s| s.name.folded() == folded) {
            return Err(AddError::Exists(existing.name.clone()));
        }
        if self.mcp_servers.len() >= MAX_SERVERS {
            return Err(AddError::Full);
        }
        self.mcp_servers.push(server);
        Ok(())
    }

    /// Remove the server with exactly this name.
    pub fn remove_server(&mut self, name: &str) -> Option<ServerConfig> {
        let at = self
            .mcp_servers
            .iter()
            .position(|s| s.name.as_str() == name)?;
        Some(self.mcp_servers.remove(at))
    }

    /// The canonical file form: pretty JSON with a final newline.
    pub fn to_json_pretty(&self) -> String {
        // Serializing these types cannot fail: every map key is a string and no value is a
        // non-finite float; an empty document would only be written if that changed, and the
        // store re-parses what it writes before committing it.
        let mut out = serde_json::to_string_pretty(self).unwrap_or_default();
        out.push('\n');
        out
    }
}

impl Serialize for Config {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Config", 8)?;
        st.serialize_field("schema_version", &SCHEMA_VERSION)?;
        if let Some(c) = &self.host_ceiling {
            st.serialize_field("host_ceiling", c)?;
        }
        st.serialize_field("mcp_servers", &self.mcp_servers)?;
        if !self.hooks.is_empty() {
            st.serialize_field("hooks", &self.hooks)?;
        }
        if !self.hooks_writable.is_empty() {
            st.serialize_field("hooks_writable", &self.hooks_writable)?;
        }
        if let Some(r) = &self.hooks_run_as {
            st.serialize_field("hooks_run_as", r)?;
        }
        if !self.network.is_empty() {
            st.serialize_field("network", &self.network)?;
        }
        if !self.approvals.is_empty() {
            st.serialize_field("approvals", &self.approvals)?;
        }
        st.end()
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding from the positioned JSON tree.

type Result2<T> = Result<T, ConfigError>;

fn err(path: &Path, pos: Pos, kind: ConfigErrorKind) -> ConfigError {
    ConfigError {
        path: path.clone(),
        pos,
        kind,
    }
}

fn value_err(path: &Path, node: &Node, e: ValueError) -> ConfigError {
    err(path, node.pos, ConfigErrorKind::Value(e))
}

fn wrong_type(path: &Path, node: &Node, expected: &'static str) -> ConfigError {
    err(
        path,
        node.pos,
        ConfigErrorKind::WrongType {
            expected,
            found: node.value.type_name(),
        },
    )
}

/// An object whose keys were checked against the schema.
struct Fields<'a> {
    members: &'a [Member],
    path: Path,
    pos: Pos,
}

impl<'a> Fields<'a> {
    fn new(node: &'a Node, path: &Path, allowed: &'static [&'static str]) -> Result2<Self> {
        let Value::Object(members) = &node.value else {
            return Err(wrong_type(path, node, "an object"));
        };
        for m in members {
            if !allowed.contains(&m.key.as_str()) {
                let mut shown = Path::root().key(&m.key).to_string();
                // Path display is `$.key` or `$["…"]`; keep only the escaped key text.
                shown = shown
                    .trim_start_matches("$.")
                    .trim_start_matches("$[\"")
                    .trim_end_matches("\"]")
                    .to_owned();
                return Err(err(
                    &path.key(&m.key),
                    m.key_pos,
                    ConfigErrorKind::UnknownKey {
                        key: shown,
                        allowed,
                    },
                ));
            }
        }
        Ok(Fields {
            members,
            path: path.clone(),
            pos: node.pos,
        })
    }

    fn get(&self, key: &str) -> Option<(&'a Node, Path)> {
        self.members
            .iter()
            .find(|m| m.key == key)
            .map(|m| (&m.node, self.path.key(key)))
    }

    fn require(&self, key: &'static str) -> Result2<(&'a Node, Path)> {
        self.get(key)
            .ok_or_else(|| err(&self.path, self.pos, ConfigErrorKind::MissingKey(key)))
    }
}

fn string<'a>(node: &'a Node, path: &Path) -> Result2<&'a str> {
    match &node.value {
        Value::String(s) => Ok(s),
        _ => Err(wrong_type(path, node, "a string")),
    }
}

fn array<'a>(node: &'a Node, path: &Path, max: usize) -> Result2<&'a [Node]> {
    let Value::Array(items) = &node.value else {
        return Err(wrong_type(path, node, "an array"));
    };
    if items.len() > max {
        return Err(err(path, node.pos, ConfigErrorKind::TooMany { max }));
    }
    Ok(items)
}

/// Decode a list of strings with a parser, refusing duplicates.
fn string_list<T: PartialEq>(
    node: &Node,
    path: &Path,
    max: usize,
    parse: impl Fn(&str) -> Result<T, ValueError>,
) -> Result2<Vec<T>> {
    let items = array(node, path, max)?;
    let mut out: Vec<T> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let p = path.index(i);
        let v = parse(string(item, &p)?).map_err(|e| value_err(&p, item, e))?;
        if let Some(j) = out.iter().position(|x| *x == v) {
            return Err(err(
                &p,
                item.pos,
                ConfigErrorKind::Duplicate {
                    first: items[j].pos,
                },
            ));
        }
        out.push(v);
    }
    Ok(out)
}

fn capability_set(node: &Node, path: &Path) -> Result2<CapabilitySet> {
    const ALLOWED: &[&str] = &[
        "read_only",
        "workspace_write",
        "process",
        "web_egress",
        "delegation",
        "irreversible_external",
    ];
    let items = array(node, path, Capability::ALL.len())?;
    let mut set = CapabilitySet::EMPTY;
    for (i, item) in items.iter().enumerate() {
        let p = path.index(i);
        let word = string(item, &p)?;
        let c = Capability::parse(word).ok_or_else(|| {
            err(
                &p,
                item.pos,
                ConfigErrorKind::UnknownWord { allowed: ALLOWED },
            )
        })?;
        if set.contains(c) {
            let first = items
                .iter()
                .find(|n| matches!(&n.value, Value::String(s) if s == word))
                .map_or(item.pos, |n| n.pos);
            return Err(err(&p, item.pos, ConfigErrorKind::Duplicate { first }));
        }
        set.insert(c);
    }
    Ok(set)
}

fn name_value<T>(r: Result<T, NameError>) -> Result<T, ValueError> {
    r.map_err(ValueError::Name)
}

fn optional<T>(
    f: &Fields<'_>,
    key: &str,
    decode: impl Fn(&Node, &Path) -> Result2<T>,
) -> Result2<Option<T>> {
    match f.get(key) {
        Some((node, path)) => decode(node, &path).map(Some),
        None => Ok(None),
    }
}

fn parsed<T>(parse: impl Fn(&str) -> Result<T, ValueError>) -> impl Fn(&Node, &Path) -> Result2<T> {
    move |node, path| parse(string(node, path)?).map_err(|e| value_err(path, node, e))
}

fn url_value(s: &str) -> Result<EndpointUrl, ValueError> {
    EndpointUrl::parse(s).map_err(ValueError::Url)
}

fn identifier_value(s: &str) -> Result<IdentifierUrl, ValueError> {
    IdentifierUrl::parse(s).map_err(ValueError::Url)
}

fn env_value(s: &str) -> Result<EnvName, ValueError> {
    name_value(EnvName::parse(s))
}

const ROOT_KEYS: &[&str] = &[
    "schema_version",
    "host_ceiling",
    "mcp_servers",
    "hooks",
    "hooks_writable",
    "hooks_run_as",
    "network",
    "approvals",
];
const SERVER_KEYS: &[&str] = &[
    "name",
    "transport",
    "command",
    "args",
    "env",
    "url",
    "header_env",
    "oauth",
    "tools",
    "policy",
    "sandbox",
];
const STDIO_ONLY: &[&str] = &["command", "args", "env", "sandbox"];
const SANDBOX_KEYS: &[&str] = &[
    "readable",
    "writable",
    "max_open_files",
    "max_memory_mb",
    "max_processes",
    "run_as",
    "network",
    "egress",
];

fn ranged(range: (u64, u64)) -> impl Fn(&Node, &Path) -> Result2<u64> {
    move |node, path| match &node.value {
        Value::Number(raw) => raw
            .parse::<u64>()
            .ok()
            .filter(|n| (range.0..=range.1).contains(n))
            .ok_or_else(|| {
                err(
                    path,
                    node.pos,
                    ConfigErrorKind::OutOfRange {
                        min: range.0,
                        max: range.1,
                    },
                )
            }),
        _ => Err(wrong_type(path, node, "an integer")),
    }
}

fn decode_sandbox(node: &Node, path: &Path) -> Result2<Sandbox> {
    let f = Fields::new(node, path, SANDBOX_KEYS)?;
    let paths = |key: &str| -> Result2<Vec<AbsolutePath>> {
        match f.get(key) {
            None => Ok(Vec::new()),
            Some((n, p)) => string_list(n, &p, MAX_SANDBOX_PATHS, AbsolutePath::parse),
        }
    };
    Ok(Sandbox {
        readable: paths("readable")?,
        writable: paths("writable")?,
        max_open_files: optional(&f, "max_open_files", ranged(OPEN_FILES_RANGE))?,
        max_memory_mb: optional(&f, "max_memory_mb", ranged(MEMORY_MB_RANGE))?,
        max_processes: optional(&f, "max_processes", ranged(PROCESSES_RANGE))?,
        run_as: optional(&f, "run_as", parsed(RunAs::parse))?,
        network: optional(&f, "network", parsed(SandboxNetwork::parse))?,
        egress: match f.get("egress") {
            None => Vec::new(),
            Some((n, p)) => string_list(n, &p, MAX_EGRESS_RULES, |s| {
                EgressRule::parse(s).map_err(ValueError::Egress)
            })?,
        },
    })
}
const HTTP_ONLY: &[&str] = &["url", "header_env", "oauth"];

fn decode_config(root: &Node) -> Result2<Config> {
    let top = Path::root();
    let Value::Object(members) = &root.value else {
        return Err(wrong_type(&top, root, "an object"));
    };
    // The version decides how everything else is read, so it is checked before any other key.
    match members.iter().find(|m| m.key == "schema_version") {
        None => {
            return Err(err(
                &top,
                root.pos,
                ConfigErrorKind::SchemaVersion { found: None },
            ));
        }
        Some(m) => {
            let found = match &m.node.value {
                Value::Number(raw) => raw.parse::<u64>().ok(),
                _ => None,
            };
            if found != Some(u64::from(SCHEMA_VERSION)) {
                return Err(err(
                    &top.key("schema_version"),
                    m.node.pos,
                    ConfigErrorKind::SchemaVersion { found },
                ));
            }
        }
    }
    let f = Fields::new(root, &top, ROOT_KEYS)?;
    let host_ceiling = optional(&f, "host_ceiling", capability_set)?;
    let mut config = Config {
        host_ceiling,
        mcp_servers: Vec::new(),
        hooks: BTreeMap::new(),
        hooks_writable: Vec::new(),
        hooks_run_as: None,
        network: NetworkConfig::default(),
        approvals: ApprovalsConfig::default(),
    };
    if let Some((node, path)) = f.get("mcp_servers") {
        let items = array(node, &path, MAX_SERVERS)?;
        let mut seen: BTreeMap<String, Pos> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            let p = path.index(i);
            let server = decode_server(item, &p)?;
            // decode_server succeeded, so the item is an object with a "name" member.
            let name_pos = match &item.value {
                Value::Object(ms) => ms
                    .iter()
                    .find(|m| m.key == "name")
                    .map_or(item.pos, |m| m.node.pos),
                _ => item.pos,
            };
            if let Some(first) = seen.get(&server.name.folded()) {
                return Err(err(
                    &p.key("name"),
                    name_pos,
                    ConfigErrorKind::Duplicate { first: *first },
                ));
            }
            seen.insert(server.name.folded(), name_pos);
            config.mcp_servers.push(server);
        }
    }
    if let Some((node, path)) = f.get("hooks_writable") {
        config.hooks_writable = string_list(node, &path, MAX_SANDBOX_PATHS, AbsolutePath::parse)?;
    }
    config.hooks_run_as = optional(&f, "hooks_run_as", parsed(RunAs::parse))?;
    if let Some((node, path)) = f.get("hooks") {
        config.hooks = decode_hooks(node, &path)?;
    }
    if let Some((node, path)) = f.get("network") {
        let nf = Fields::new(node, &path, &["nameservers", "ca_bundle"])?;
        if let Some((n, p)) = nf.get("nameservers") {
            config.network.nameservers = string_list(n, &p, MAX_NAMESERVERS, Nameserver::parse)?;
        }
        config.network.ca_bundle = optional(&nf, "ca_bundle", parsed(AbsolutePath::parse))?;
    }
    if let Some((node, path)) = f.get("approvals") {
        config.approvals = decode_approvals(node, &path)?;
    }
    Ok(config)
}

fn decode_approvals(node: &Node, path: &Path) -> Result2<ApprovalsConfig> {
    let f = Fields::new(node, path, &["deferred_secs", "rules"])?;
    let mut out = ApprovalsConfig {
        rules: Vec::new(),
        deferred_secs: optional(&f, "deferred_secs", ranged(DEFERRED_SECS_RANGE))?,
    };
    if let Some((n, p)) = f.get("rules") {
        let items = array(n, &p, MAX_RULES)?;
        let mut seen: BTreeMap<RuleId, Pos> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            let ip = p.index(i);
            let rule = decode_rule(item, &ip)?;
            // decode_rule succeeded, so the item is an object with an "id" member.
            let id_pos = match &item.value {
                Value::Object(ms) => ms
                    .iter()
                    .find(|m| m.key == "id")
                    .map_or(item.pos, |m| m.node.pos),
                _ => item.pos,
            };
            if let Some(first) = seen.get(&rule.id) {
                return Err(err(
                    &ip.key("id"),
                    id_pos,
                    ConfigErrorKind::Duplicate { first: *first },
                ));
            }
            seen.insert(rule.id.clone(), id_pos);
            out.rules.push(rule);
        }
    }
    Ok(out)
}

const CONSTRAINT_KEYS: &[&str] = &["any", "equals", "one_of", "prefix", "range"];

fn decode_rule(node: &Node, path: &Path) -> Result2<Rule> {
    let f = Fields::new(node, path, crate::rules::RULE_KEYS)?;
    let id = {
        let (n, p) = f.require("id")?;
        parsed(|s| name_value(RuleId::parse(s)))(n, &p)?
    };
    let effect = {
        let (n, p) = f.require("effect")?;
        Effect::parse(string(n, &p)?).ok_or_else(|| {
            err(
                &p,
                n.pos,
                ConfigErrorKind::UnknownWord {
                    allowed: &["allow", "deny"],
                },
            )
        })?
    };
    let server = {
        let (n, p) = f.require("server")?;
        parsed(|s| name_value(ServerName::parse(s)))(n, &p)?
    };
    let tool = {
        let (n, p) = f.require("tool")?;
        parsed(|s| name_value(RuleTool::parse(s)))(n, &p)?
    };
    let arguments = match f.get("arguments") {
        None => None,
        Some((n, p)) => Some(decode_arguments(n, &p)?),
    };
    let digest = |s: &str| Sha256Hex::parse(s).ok_or(ValueError::BadDigest);
    let args_sha256 = optional(&f, "args_sha256", parsed(digest))?;
    let agent_uids = match f.get("agent_uids") {
        None => Vec::new(),
        Some((n, p)) => {
            let items = array(n, &p, MAX_RULE_UIDS)?;
            let mut uids: Vec<u32> = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let ip = p.index(i);
                let uid = ranged((0, u64::from(MAX_UID)))(item, &ip)?;
                // ranged bounded it to MAX_UID, which fits a u32.
                let uid = u32::try_from(uid).unwrap_or(u32::MAX);
                if let Some(j) = uids.iter().position(|u| *u == uid) {
                    return Err(err(
                        &ip,
                        item.pos,
                        ConfigErrorKind::Duplicate {
                            first: items[j].pos,
                        },
                    ));
                }
                uids.push(uid);
            }
            uids
        }
    };
    let agent_identities = match f.get("agent_identities") {
        None => Vec::new(),
        Some((n, p)) => string_list(n, &p, MAX_RULE_IDENTITIES, digest)?,
    };
    let mut counts = [None, None];
    for (slot, key) in counts
        .iter_mut()
        .zip(["max_calls_per_run", "max_calls_per_session"])
    {
        if let Some((n, p)) = f.get(key) {
            if effect == Effect::Deny {
                return Err(err(&p, n.pos, ConfigErrorKind::NotForDeny { key }));
            }
            *slot = Some(ranged(MAX_CALLS_RANGE)(n, &p)?);
        }
    }
    let expires = optional(
        &f,
        "expires",
        parsed(|s| Expiry::parse(s).ok_or(ValueError::BadTime)),
    )?;
    Ok(Rule {
        id,
        effect,
        server,
        tool,
        arguments,
        args_sha256,
        agent_uids,
        agent_identities,
        max_calls_per_run: counts[0],
        max_calls_per_session: counts[1],
        expires,
    })
}

fn decode_arguments(node: &Node, path: &Path) -> Result2<BTreeMap<String, Constraint>> {
    let f = Fields::new_any(node, path)?;
    if f.members.len() > MAX_RULE_ARGUMENTS {
        return Err(err(
            path,
            node.pos,
            ConfigErrorKind::TooMany {
                max: MAX_RULE_ARGUMENTS,
            },
        ));
    }
    let mut out = BTreeMap::new();
    for m in f.members {
        let kp = path.key(&m.key);
        check_text(&m.key, MAX_ARGUMENT_NAME)
            .map_err(|e| err(&kp, m.key_pos, ConfigErrorKind::Value(e)))?;
        out.insert(m.key.clone(), decode_constraint(&m.node, &kp)?);
    }
    Ok(out)
}

fn decode_constraint(node: &Node, path: &Path) -> Result2<Constraint> {
    let f = Fields::new(node, path, CONSTRAINT_KEYS)?;
    let [m] = f.members else {
        return Err(err(
            path,
            node.pos,
            ConfigErrorKind::ExactlyOne {
                allowed: CONSTRAINT_KEYS,
            },
        ));
    };
    let p = path.key(&m.key);
    let n = &m.node;
    Ok(match m.key.as_str() {
        "any" => match n.value {
            Value::Bool(true) => Constraint::Any,
            _ => {
                return Err(err(
                    &p,
                    n.pos,
                    ConfigErrorKind::UnknownWord { allowed: &["true"] },
                ));
            }
        },
        "equals" => Constraint::Equals(scalar(n, &p)?),
        "one_of" => {
            let items = array(n, &p, MAX_ONE_OF)?;
            if items.is_empty() {
                return Err(value_err(&p, n, ValueError::Empty));
            }
            let mut values: Vec<Scalar> = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let ip = p.index(i);
                let v = scalar(item, &ip)?;
                if let Some(j) = values.iter().position(|x| *x == v) {
                    return Err(err(
                        &ip,
                        item.pos,
                        ConfigErrorKind::Duplicate {
                            first: items[j].pos,
                        },
                    ));
                }
                values.push(v);
            }
            Constraint::OneOf(values)
        }
        "prefix" => {
            let s = string(n, &p)?;
            check_text(s, MAX_STRING_BYTES).map_err(|e| value_err(&p, n, e))?;
            Constraint::Prefix(s.to_owned())
        }
        _ => {
            let rf = Fields::new(n, &p, &["min", "max"])?;
            let (min_n, min_p) = rf.require("min")?;
            let (max_n, max_p) = rf.require("max")?;
            let min = int64(min_n, &min_p)?;
            let max = int64(max_n, &max_p)?;
            if min > max {
                return Err(err(&p, n.pos, ConfigErrorKind::RangeInverted));
            }
            Constraint::Range { min, max }
        }
    })
}

/// An integer that fits an `i64`, written as one (no fraction, no exponent).
fn int64(node: &Node, path: &Path) -> Result2<i64> {
    match &node.value {
        Value::Number(raw) => raw
            .parse::<i64>()
            .map_err(|_| wrong_type(path, node, "a 64-bit integer")),
        _ => Err(wrong_type(path, node, "a 64-bit integer")),
    }
}

/// A constraint's value: a string (bounded, displayable), an integer or a boolean.
fn scalar(node: &Node, path: &Path) -> Result2<Scalar> {
    match &node.value {
        Value::String(s) => {
            // An exact value may be empty (an empty argument is a value like any other).
            if !s.is_empty() {
                check_text(s, MAX_STRING_BYTES).map_err(|e| value_err(path, node, e))?;
            }
            Ok(Scalar::String(s.clone()))
        }
        Value::Bool(b) => Ok(Scalar::Bool(*b)),
        Value::Number(_) => int64(node, path).map(Scalar::Integer),
        _ => Err(wrong_type(path, node, "a string, an integer or a boolean")),
    }
}

fn decode_hooks(node: &Node, path: &Path) -> Result2<BTreeMap<HookEvent, Vec<AbsolutePath>>> {
    let f = Fields::new(node, path, HookEvent::NAMES)?;
    let mut hooks = BTreeMap::new();
    for m in f.members {
        // Fields::new admitted only the event names, so parse always succeeds here; an unknown
        // word would already have been reported as an unknown key.
        let Some(event) = HookEvent::parse(&m.key) else {
            continue;
        };
        let p = path.key(&m.key);
        let commands = string_list(&m.node, &p, MAX_HOOKS_PER_EVENT, AbsolutePath::parse)?;
        hooks.insert(event, commands);
    }
    Ok(hooks)
}

fn decode_server(node: &Node, path: &Path) -> Result2<ServerConfig> {
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
    fn new_any(node: &'a Node, path: &Path) -> Result2<Self> {
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

#[cfg(test)]
mod tests;
