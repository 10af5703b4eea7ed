//! The operator configuration, `schema_version: 2`.
//!
//! The file is the operator's statement of authority, so it is read strictly: unknown keys,
//! duplicate keys, values of the wrong type, names outside their grammar, unsafe URLs and
//! deceptive Unicode are all errors, each naming the JSON path and the line and column. Any
//! `schema_version` other than [`SCHEMA_VERSION`] is refused by name. Every list and string has an
//! explicit bound. Secrets never live here: headers and OAuth material are *named* by environment
//! variable, and error texts never quote a value from the file.

use std::collections::BTreeMap;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use crate::capability::{CapabilitySet, ServerPolicy, ToolFilter};
use crate::egress::EgressRule;
use crate::json::{self, Path, Pos};
use crate::names::{EnvName, HeaderName, ServerName};
use crate::rules::ApprovalsConfig;
use crate::url::{EndpointUrl, IdentifierUrl};

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

mod decode;
mod error;
mod values;

use decode::decode_config;
pub use error::{AddError, ConfigError, ConfigErrorKind};
pub use values::{AbsolutePath, ClientId, Command, Scope, ValueError, check_arg};

#[cfg(test)]
mod tests;
