//! The operator's configuration on disk: `$ITERON_HOME/config.json` (default `~/.iteron`).
//!
//! Guarantees:
//! - the directory is created 0700 and the file 0600 *at creation* (never chmod afterwards);
//! - a directory or file that is a symlink, not owned by the effective uid, or has any group or
//!   other permission bit is refused (never repaired): someone else changed it, and the operator
//!   must look before Iteron trusts it again; the error names the exact `chmod` to run;
//! - every read-modify-write holds an exclusive lock on `config.lock`, writes a new temp file
//!   (`O_EXCL`, `O_NOFOLLOW`), fsyncs it, renames it over the config and fsyncs the directory,
//!   so a crash leaves either the old or the new file and concurrent writers lose no update;
//! - a configuration that does not parse is never rewritten, and nothing is written that this
//!   build could not read back;
//! - reads are bounded to [`MAX_CONFIG_BYTES`] (+1 byte to detect oversize);
//! - in a build without the keyring backend (the `keyring` cargo feature), a configuration in
//!   which a server keeps its OAuth secrets in the keyring (`oauth.credential_store:
//!   "keyring"`) is refused when read and never written: it is not downgraded to the file store.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::keyring;
use crate::private_fs::{self, FsError};
use iteron_policy::config::{Config, ConfigError, CredentialBackend, MAX_CONFIG_BYTES, Transport};

/// The configuration file's name inside the home directory.
pub const CONFIG_FILE: &str = "config.json";
/// The lock file's name inside the home directory.
pub const LOCK_FILE: &str = "config.lock";
/// Prefix of temp files; anything with it is a leftover of a crashed writer.
const TEMP_PREFIX: &str = ".config.json.tmp-";
/// How long a writer waits for the lock before giving up.
pub const LOCK_TIMEOUT: Duration = private_fs::LOCK_TIMEOUT;

/// Everything that can go wrong with the store. `Display` is one line with no file content.
#[derive(Debug)]
pub enum StoreError {
    /// A private file or directory is unsafe to use, or a system call on it failed.
    Fs(FsError),
    /// Neither `ITERON_HOME` nor `HOME` is set.
    NoHome,
    /// `ITERON_HOME`/`HOME` is not an absolute path.
    NotAbsolute(PathBuf),
    /// The file exceeds [`MAX_CONFIG_BYTES`].
    TooLarge(PathBuf),
    /// The file does not parse; it is left untouched.
    Invalid {
        /// The file.
        path: PathBuf,
        /// Why.
        error: ConfigError,
    },
    /// The new configuration would exceed [`MAX_CONFIG_BYTES`]; nothing was written.
    WouldExceed,
    /// The serialized configuration did not read back identically; nothing was written.
    RoundTrip,
    /// A server keeps its OAuth secrets in the keyring, and this build has no keyring backend;
    /// the file is left untouched.
    KeyringNotBuilt {
        /// The file.
        path: PathBuf,
        /// The first such server.
        server: String,
    },
    /// The new configuration would keep a server's OAuth secrets in the keyring, and this build
    /// has no keyring backend; nothing was written.
    WouldNeedKeyring {
        /// The first such server.
        server: String,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Fs(e) => e.fmt(f),
            StoreError::NoHome => f.write_str(
                "cannot locate the Iteron home: set ITERON_HOME or HOME to an absolute path",
            ),
            StoreError::NotAbsolute(p) => {
                write!(f, "{} is not an absolute path (ITERON_HOME/HOME)", p.display())
            }
            StoreError::TooLarge(p) => write!(
                f,
                "{} is larger than {MAX_CONFIG_BYTES} bytes; refusing to read it",
                p.display()
            ),
            StoreError::Invalid { path, error } => {
                write!(f, "invalid configuration {}: {error}", path.display())
            }
            StoreError::WouldExceed => write!(
                f,
                "the configuration would exceed {MAX_CONFIG_BYTES} bytes; nothing was written"
            ),
            StoreError::RoundTrip => f.write_str(
                "internal error: the new configuration did not read back identically; nothing was written",
            ),
            StoreError::KeyringNotBuilt { path, server } => write!(
                f,
                "invalid configuration {}: server {server} keeps its OAuth secrets in the keyring (oauth.credential_store \"keyring\"), but {}; nothing falls back to the file store",
                path.display(),
                keyring::KeyringError::NotBuiltIn.reason()
            ),
            StoreError::WouldNeedKeyring { server } => write!(
                f,
                "server {server} would keep its OAuth secrets in the keyring (oauth.credential_store \"keyring\"), but {}; nothing was written",
                keyring::KeyringError::NotBuiltIn.reason()
            ),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Fs(e) => e.source(),
            StoreError::Invalid { error, .. } => Some(error),
            _ => None,
        }
    }
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError + use<> {
    let path = path.to_path_buf();
    move |source| StoreError::Fs(FsError::Io { op, path, source })
}

/// The Iteron home directory.
#[derive(Debug, Clone)]
pub struct Home {
    dir: PathBuf,
}

impl Home {
    /// Locate the home from an environment lookup (passed in so that callers and tests never
    /// mutate the process environment): `ITERON_HOME`, else `$HOME/.iteron`.
    pub fn from_env(var: impl Fn(&str) -> Option<OsString>) -> Result<Home, StoreError> {
        let dir = match var("ITERON_HOME").filter(|v| !v.is_empty()) {
            Some(v) => PathBuf::from(v),
            None => {
                let home = var("HOME")
                    .filter(|v| !v.is_empty())
                    .ok_or(StoreError::NoHome)?;
                PathBuf::from(home).join(".iteron")
            }
        };
        Home::at(dir)
    }

    /// A home at an explicit absolute path. The path is rebuilt from its components, so a
    /// trailing `/` (which would make the kernel follow a symlink in the last component) is gone.
    pub fn at(dir: PathBuf) -> Result<Home, StoreError> {
        if !dir.is_absolute() {
            return Err(StoreError::NotAbsolute(dir));
        }
        Ok(Home {
            dir: dir.components().collect(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration file's path.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    /// Read the configuration. A missing directory or file is an empty configuration; nothing is
    /// created.
    pub fn load(&self) -> Result<Config, StoreError> {
        match fs::symlink_metadata(&self.dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Config::default()),
            Err(e) => return Err(io_err("inspect", &self.dir)(e)),
            Ok(meta) => private_fs::check_private(&self.dir, &meta, true)?,
        }
        self.read_config()
    }

    /// Read-modify-write under the exclusive lock. `change` sees the current configuration and
    /// may refuse (its error is returned and nothing is written). If `change` succeeds the new
    /// configuration is written atomically.
    pub fn update<T, E>(&self, change: impl FnOnce(&mut Config) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        self.ensure_dir()?;
        let lock_path = self.dir.join(LOCK_FILE);
        let lock = private_fs::acquire_lock(&lock_path).map_err(StoreError::from)?;
        private_fs::remove_stale_temps(&self.dir, TEMP_PREFIX);
        let mut config = self.read_config()?;
        let result = change(&mut config)?;
        self.write_config(&config)?;
        drop(lock);
        Ok(result)
    }

    fn ensure_dir(&self) -> Result<(), StoreError> {
        match fs::DirBuilder::new().mode(0o700).create(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("create directory", &self.dir)(e)),
        }
        let meta = fs::symlink_metadata(&self.dir).map_err(io_err("inspect", &self.dir))?;
        Ok(private_fs::check_private(&self.dir, &meta, true)?)
    }

    fn read_config(&self) -> Result<Config, StoreError> {
        let path = self.config_path();
        // O_NONBLOCK: a FIFO planted as config.json must not block the open; it is then refused
        // by the type check below.
        let flags = nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK;
        let file = match OpenOptions::new()
            .read(true)
            .custom_flags(flags.bits())
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Config::default()),
            Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
                return Err(StoreError::Fs(FsError::NotPlain {
                    path,
                    expected: "regular file",
                }));
            }
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        let meta = file.metadata().map_err(io_err("inspect", &path))?;
        private_fs::check_private(&path, &meta, false)?;
        let mut bytes = Vec::new();
        // Read one byte past the bound so an oversized file is detected, never truncated.
        let limit = u64::try_from(MAX_CONFIG_BYTES).map_or(u64::MAX, |m| m.saturating_add(1));
        file.take(limit)
            .read_to_end(&mut bytes)
            .map_err(io_err("read", &path))?;
        if bytes.len() > MAX_CONFIG_BYTES {
            return Err(StoreError::TooLarge(path));
        }
        let config = Config::parse(&bytes).map_err(|error| StoreError::Invalid {
            path: path.clone(),
            error,
        })?;
        if let Some(server) = keyring_server_without_backend(&config, keyring::BUILT_IN) {
            return Err(StoreError::KeyringNotBuilt {
                path,
                server: server.to_owned(),
            });
        }
        Ok(config)
    }

    fn write_config(&self, config: &Config) -> Result<(), StoreError> {
        if let Some(server) = keyring_server_without_backend(config, keyring::BUILT_IN) {
            return Err(StoreError::WouldNeedKeyring {
                server: server.to_owned(),
            });
        }
        let text = config.to_json_pretty();
        if text.len() > MAX_CONFIG_BYTES {
            return Err(StoreError::WouldExceed);
        }
        match Config::parse(text.as_bytes()) {
            Ok(back) if back == *config => {}
            _ => return Err(StoreError::RoundTrip),
        }
        let target = self.config_path();
        private_fs::replace_file(&self.dir, TEMP_PREFIX, &target, text.as_bytes())?;
        Ok(())
    }
}

impl From<FsError> for StoreError {
    fn from(e: FsError) -> Self {
        StoreError::Fs(e)
    }
}

/// The first server of `config` that keeps its OAuth secrets in the keyring, when the build
/// has no keyring backend (`built_in` is [`keyring::BUILT_IN`]); `None` when the build can use
/// everything the configuration names.
fn keyring_server_without_backend(config: &Config, built_in: bool) -> Option<&str> {
    if built_in {
        return None;
    }
    config.mcp_servers.iter().find_map(|s| match &s.transport {
        Transport::Http(h)
            if h.oauth.as_ref().and_then(|o| o.credential_store)
                == Some(CredentialBackend::Keyring) =>
        {
            Some(s.name.as_str())
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iteron_policy::config::{Command, ServerConfig, StdioServer, Transport};
    use iteron_policy::names::ServerName;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn temp_home() -> (PathBuf, Home) {
        static N: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir().join(format!(
            "iteron-store-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).unwrap();
        let home = Home::at(base.join("home")).unwrap();
        (base, home)
    }

    fn server(name: &str) -> ServerConfig {
        ServerConfig {
            name: ServerName::parse(name).unwrap(),
            transport: Transport::Stdio(StdioServer {
                command: Command::parse("/bin/true").unwrap(),
                args: vec![],
                env: vec![],
                sandbox: Default::default(),
            }),
            tools: Default::default(),
            policy: Default::default(),
        }
    }

    fn add(home: &Home, name: &str) {
        home.update(|c| {
            c.add_server(server(name))
                .map_err(|_| StoreError::RoundTrip)
        })
        .unwrap();
    }

    const KEYRING_CONFIG: &[u8] = br#"{"schema_version": 2, "mcp_servers": [
        {"name": "files", "transport": "http", "url": "https://files.example/", "oauth": {"credential_store": "file"}},
        {"name": "kr", "transport": "http", "url": "https://kr.example/", "oauth": {"credential_store": "keyring"}}
    ]}"#;

    #[test]
    fn only_a_build_without_the_keyring_finds_a_keyring_server_to_refuse() {
        let config = Config::parse(KEYRING_CONFIG).unwrap();
        assert_eq!(keyring_server_without_backend(&config, false), Some("kr"));
        assert_eq!(keyring_server_without_backend(&config, true), None);
        let mut files_only = config.clone();
        files_only.mcp_servers.retain(|s| s.name.as_str() != "kr");
        files_only.mcp_servers.push(server("stdio"));
        assert_eq!(keyring_server_without_backend(&files_only, false), None);
    }

    /// Write `bytes` as the home's configuration, private as the store makes it.
    fn plant_config(home: &Home, bytes: &[u8]) {
        add(home, "placeholder");
        fs::write(home.config_path(), bytes).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn a_build_with_the_keyring_reads_and_writes_a_keyring_configuration() {
        let (base, home) = temp_home();
        plant_config(&home, KEYRING_CONFIG);
        assert_eq!(home.load().unwrap().mcp_servers.len(), 2);
        add(&home, "more");
        assert_eq!(home.load().unwrap().mcp_servers.len(), 3);
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(not(feature = "keyring"))]
    #[test]
    fn a_build_without_the_keyring_refuses_a_keyring_configuration_and_never_downgrades_it() {
        let (base, home) = temp_home();
        plant_config(&home, KEYRING_CONFIG);
        let e = home.load().unwrap_err();
        assert!(
            matches!(&e, StoreError::KeyringNotBuilt { server, .. } if server == "kr"),
            "{e}"
        );
        let line = e.to_string();
        assert!(!line.contains('\n'), "{line}");
        for part in [
            home.config_path().to_str().unwrap(),
            "server kr",
            "built without the keyring backend",
            "nothing falls back to the file store",
        ] {
            assert!(line.contains(part), "{part}: {line}");
        }
        // Read-modify-write refuses it too, and the file stays byte for byte.
        let r = home.update(|c| c.add_server(server("b")).map_err(|_| StoreError::RoundTrip));
        assert!(matches!(r, Err(StoreError::KeyringNotBuilt { .. })));
        assert_eq!(fs::read(home.config_path()).unwrap(), KEYRING_CONFIG);

        // A change that would name the keyring is never written.
        let (base2, home2) = temp_home();
        add(&home2, "a");
        let before = fs::read(home2.config_path()).unwrap();
        let kr = Config::parse(KEYRING_CONFIG).unwrap().mcp_servers.remove(1);
        let r = home2.update(|c| c.add_server(kr).map_err(|_| StoreError::RoundTrip));
        let e = r.unwrap_err();
        assert!(
            matches!(&e, StoreError::WouldNeedKeyring { server } if server == "kr"),
            "{e}"
        );
        assert!(e.to_string().ends_with("nothing was written"), "{e}");
        assert_eq!(fs::read(home2.config_path()).unwrap(), before);
        assert_eq!(home2.load().unwrap().mcp_servers.len(), 1);
        fs::remove_dir_all(base).unwrap();
        fs::remove_dir_all(base2).unwrap();
    }

    #[test]
    fn missing_home_reads_as_empty_and_creates_nothing() {
        let (base, home) = temp_home();
        assert_eq!(home.load().unwrap(), Config::default());
        assert!(!home.dir().exists());
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn first_write_creates_private_directory_and_file() {
        let (base, home) = temp_home();
        add(&home, "a");
        let dmode = fs::metadata(home.dir()).unwrap().permissions().mode() & 0o777;
        let fmode = fs::metadata(home.config_path())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!((dmode, fmode), (0o700, 0o600));
        assert_eq!(home.load().unwrap().mcp_servers.len(), 1);
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_refused_change_writes_nothing() {
        let (base, home) = temp_home();
        add(&home, "a");
        let before = fs::read(home.config_path()).unwrap();
        let r: Result<(), StoreError> = home.update(|c| {
            c.mcp_servers.clear();
            Err(StoreError::WouldExceed)
        });
        assert!(r.is_err());
        assert_eq!(fs::read(home.config_path()).unwrap(), before);
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn an_unparsable_config_is_never_rewritten() {
        let (base, home) = temp_home();
        add(&home, "a");
        let broken = b"{\"schema_version\": 2, \"mcp_servers\": [,]}";
        fs::write(home.config_path(), broken).unwrap();
        let r = home.update(|c| c.add_server(server("b")).map_err(|_| StoreError::RoundTrip));
        assert!(matches!(r, Err(StoreError::Invalid { .. })));
        assert_eq!(fs::read(home.config_path()).unwrap(), broken);
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn open_modes_are_refused_not_repaired() {
        let (base, home) = temp_home();
        add(&home, "a");
        fs::set_permissions(home.config_path(), fs::Permissions::from_mode(0o644)).unwrap();
        let e = home.load().unwrap_err();
        assert!(
            matches!(e, StoreError::Fs(FsError::OpenMode { mode: 0o644, .. })),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"));
        assert_eq!(
            fs::metadata(home.config_path())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o644
        );
        fs::set_permissions(home.config_path(), fs::Permissions::from_mode(0o600)).unwrap();
        fs::set_permissions(home.dir(), fs::Permissions::from_mode(0o750)).unwrap();
        assert!(matches!(
            home.load().unwrap_err(),
            StoreError::Fs(FsError::OpenMode {
                mode: 0o750,
                want: 0o700,
                ..
            })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_symlinked_config_is_refused() {
        let (base, home) = temp_home();
        add(&home, "a");
        let elsewhere = base.join("elsewhere.json");
        fs::rename(home.config_path(), &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, home.config_path()).unwrap();
        assert!(matches!(
            home.load().unwrap_err(),
            StoreError::Fs(FsError::NotPlain { .. })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_config_owned_by_another_uid_is_refused() {
        // Needs root to hand the file to uid 65534 (CI runs as root).
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: not root, cannot chown");
            return;
        }
        let (base, home) = temp_home();
        add(&home, "a");
        let nobody = Some(nix::unistd::Uid::from_raw(65534));
        nix::unistd::chown(&home.config_path(), nobody, None).unwrap();
        assert!(matches!(
            home.load().unwrap_err(),
            StoreError::Fs(FsError::WrongOwner { owner: 65534, .. })
        ));
        nix::unistd::chown(&home.config_path(), Some(nix::unistd::geteuid()), None).unwrap();
        nix::unistd::chown(home.dir(), nobody, None).unwrap();
        assert!(matches!(
            home.load().unwrap_err(),
            StoreError::Fs(FsError::WrongOwner { owner: 65534, .. })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_fifo_in_place_of_the_config_is_refused_without_blocking() {
        let (base, home) = temp_home();
        add(&home, "a");
        fs::remove_file(home.config_path()).unwrap();
        nix::unistd::mkfifo(
            &home.config_path(),
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .unwrap();
        assert!(matches!(
            home.load().unwrap_err(),
            StoreError::Fs(FsError::NotPlain { .. })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_trailing_slash_cannot_smuggle_a_symlinked_home() {
        let (base, _) = temp_home();
        let real = base.join("real");
        fs::create_dir(&real).unwrap();
        fs::set_permissions(&real, fs::Permissions::from_mode(0o700)).unwrap();
        let link = base.join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let home = Home::at(PathBuf::from(format!("{}/", link.display()))).unwrap();
        assert!(matches!(
            home.load().unwrap_err(),
            StoreError::Fs(FsError::NotPlain { .. })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn oversized_file_is_refused_one_byte_over() {
        let (base, home) = temp_home();
        add(&home, "a");
        let doc = "{\"schema_version\": 2}";
        let exact = format!("{doc}{}", " ".repeat(MAX_CONFIG_BYTES - doc.len()));
        fs::write(home.config_path(), &exact).unwrap();
        home.load().unwrap();
        fs::write(home.config_path(), format!("{exact} ")).unwrap();
        assert!(matches!(home.load().unwrap_err(), StoreError::TooLarge(_)));
        fs::remove_dir_all(base).unwrap();
        iteron_test_support::record!("P5", serde_json::json!({}),);
    }

    #[test]
    fn stale_temp_files_from_a_crashed_writer_are_cleared() {
        let (base, home) = temp_home();
        add(&home, "a");
        let stale = home.dir().join(format!("{TEMP_PREFIX}999-0"));
        fs::write(&stale, "partial").unwrap();
        add(&home, "b");
        assert!(!stale.exists());
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn concurrent_writers_in_threads_lose_no_update() {
        let (base, home) = temp_home();
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let h = home.clone();
                std::thread::spawn(move || add(&h, &format!("t{i}")))
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(home.load().unwrap().mcp_servers.len(), 8);
        fs::remove_dir_all(base).unwrap();
        iteron_test_support::record!("P6", serde_json::json!({}),);
    }

    // ---- kill -9 during configuration writes -------------------------------------------------

    const CHILD_ENV: &str = "ITERON_STORE_CHILD";
    const CHILD_WRITES: usize = 300;
    const KILL_ROUNDS: usize = 5;
    /// Servers rewritten by every write, so a torn write would show mixed sequence numbers.
    const SERVERS_PER_WRITE: usize = 12;

    /// One write: every server carries the sequence number in its first argument.
    fn write_seq(home: &Home, seq: usize) {
        home.update(|c| {
            c.mcp_servers.clear();
            for i in 0..SERVERS_PER_WRITE {
                let mut s = server(&format!("c{i}"));
                if let Transport::Stdio(st) = &mut s.transport {
                    st.args = vec![seq.to_string(), "x".repeat(64)];
                }
                c.add_server(s).map_err(|_| StoreError::RoundTrip)?;
            }
            Ok::<_, StoreError>(())
        })
        .unwrap();
    }

    /// The sequence number of the stored configuration, checking every server agrees.
    fn checked_seq(home: &Home) -> usize {
        let config = home.load().unwrap();
        assert_eq!(config.mcp_servers.len(), SERVERS_PER_WRITE);
        let seqs: Vec<usize> = config
            .mcp_servers
            .iter()
            .map(|s| match &s.transport {
                Transport::Stdio(st) => st.args[0].parse().unwrap(),
                Transport::Http(_) => panic!("unexpected transport"),
            })
            .collect();
        assert!(seqs.iter().all(|&q| q == seqs[0]), "torn write: {seqs:?}");
        seqs[0]
    }

    #[test]
    fn kill_9_during_configuration_writes_always_leaves_a_whole_private_file() {
        if let Some(dir) = std::env::var_os(CHILD_ENV) {
            // Child mode: keep writing, continuing from whatever the file holds.
            let home = Home::at(PathBuf::from(dir)).unwrap();
            let start = checked_seq(&home);
            for seq in start + 1..=start + CHILD_WRITES {
                write_seq(&home, seq);
            }
            return;
        }
        let (base, home) = temp_home();
        write_seq(&home, 0);
        let module = module_path!().split_once("::").unwrap().1;
        let test_name = format!(
            "{module}::kill_9_during_configuration_writes_always_leaves_a_whole_private_file"
        );
        let exe = std::env::current_exe().unwrap();
        let mut last = 0;
        let mut killed = 0;
        for round in 1..=KILL_ROUNDS {
            let mut child = std::process::Command::new(&exe)
                .args(["--exact", &test_name, "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, home.dir())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            // Kill somewhere inside this child's run: after it passes a write number that
            // varies per round, plus a sub-write delay that varies too.
            let target = last + 1 + (round * 53) % (CHILD_WRITES - 1);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
            while checked_seq(&home) < target
                && std::time::Instant::now() < deadline
                && child.try_wait().unwrap().is_none()
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            std::thread::sleep(std::time::Duration::from_micros(
                (round as u64 * 617) % 3_000,
            ));
            let _ = child.kill(); // SIGKILL
            let status = child.wait().unwrap();
            if std::os::unix::process::ExitStatusExt::signal(&status) == Some(nix::libc::SIGKILL) {
                killed += 1;
            } else {
                assert!(status.success(), "round {round}: child failed: {status:?}");
            }
            let meta = fs::metadata(home.config_path()).unwrap();
            assert_eq!(meta.permissions().mode() & 0o777, 0o600, "round {round}");
            let seq = checked_seq(&home);
            assert!(
                seq >= last,
                "round {round}: rolled back from {last} to {seq}"
            );
            assert!(
                seq <= round * CHILD_WRITES,
                "round {round}: {seq} was never written"
            );
            last = seq;
        }
        assert!(last > 0, "no child ever wrote");
        assert!(killed > 0, "no child was killed mid-run");
        // The next writer clears the temp files of killed writers.
        write_seq(&home, last + 1);
        let leftovers: Vec<String> = fs::read_dir(home.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(TEMP_PREFIX))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        fs::remove_dir_all(base).unwrap();
        iteron_test_support::record!("P6", serde_json::json!({}),);
    }

    #[test]
    fn home_comes_from_iteron_home_then_home() {
        let env = |k: &str| match k {
            "HOME" => Some(OsString::from("/h")),
            _ => None,
        };
        assert_eq!(Home::from_env(env).unwrap().dir(), Path::new("/h/.iteron"));
        let env = |k: &str| match k {
            "ITERON_HOME" => Some(OsString::from("/x/y")),
            "HOME" => Some(OsString::from("/h")),
            _ => None,
        };
        assert_eq!(Home::from_env(env).unwrap().dir(), Path::new("/x/y"));
        assert!(matches!(
            Home::from_env(|_| Some(OsString::from("rel"))),
            Err(StoreError::NotAbsolute(_))
        ));
        assert!(matches!(Home::from_env(|_| None), Err(StoreError::NoHome)));
    }
}
