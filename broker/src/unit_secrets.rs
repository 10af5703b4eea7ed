//! Secrets the service manager hands the broker: systemd's `LoadCredential=` /
//! `LoadCredentialEncrypted=` place one file per credential in `$CREDENTIALS_DIRECTORY`.
//!
//! A credential whose name is a valid environment variable name supplies the value of that
//! variable wherever the configuration forwards one by name (`env`, `header_env`, token and
//! client-secret variables); it wins over the broker's own environment. Everything is read once,
//! at start, and checked: the directory and each file must belong to the broker's uid or root,
//! must not be writable by group or others, and must not be symbolic links; a value is at most
//! [`MAX_VALUE`] bytes (one trailing newline is dropped) and holds no NUL byte; the directory
//! holds at most [`MAX_ENTRIES`] entries. Anything wrong stops the start with a one-line
//! reason that names the file, never its content. Entries whose names are not variable names,
//! and variables the broker strips from its own environment (loader, proxy, TLS roots), are
//! ignored and named at start.
//!
//! The directory is also denied to every child the broker starts ([`crate::confine`]), like the
//! operator home: a server receives the one value its configuration forwards, never the others.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use iteron_policy::names::EnvName;
use zeroize::Zeroizing;

/// The variable systemd sets.
pub const VAR: &str = "CREDENTIALS_DIRECTORY";
/// Largest value accepted, in bytes.
pub const MAX_VALUE: u64 = 64 * 1024;
/// Most directory entries looked at; more stops the start.
pub const MAX_ENTRIES: usize = 256;

/// Why the credentials directory cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitSecretsError {
    /// `$CREDENTIALS_DIRECTORY` is not an absolute path.
    NotAbsolute,
    /// The directory or a file could not be inspected or read.
    Io {
        /// Which path.
        path: PathBuf,
        /// What failed (an OS error's description, never a value).
        what: String,
    },
    /// The directory or a file fails a check.
    Unsafe {
        /// Which path.
        path: PathBuf,
        /// Which check.
        why: &'static str,
    },
    /// More than [`MAX_ENTRIES`] entries.
    TooMany,
}

impl fmt::Display for UnitSecretsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnitSecretsError::NotAbsolute => write!(f, "${VAR} must be an absolute path"),
            // The path goes last: a credential's name is often secret-looking, and a name
            // followed by a colon would read (and be redacted) as a name and its value.
            UnitSecretsError::Io { path, what } => {
                write!(f, "credentials directory: {what}: {}", path.display())
            }
            UnitSecretsError::Unsafe { path, why } => {
                write!(f, "credentials directory: {why}: {}", path.display())
            }
            UnitSecretsError::TooMany => write!(
                f,
                "credentials directory: more than {MAX_ENTRIES} entries; refusing to read it"
            ),
        }
    }
}

impl std::error::Error for UnitSecretsError {}

/// The credentials read at start. Values are zeroed when dropped and never printed.
pub struct UnitSecrets {
    dir: PathBuf,
    values: BTreeMap<String, Zeroizing<Vec<u8>>>,
    ignored: Vec<String>,
}

impl fmt::Debug for UnitSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnitSecrets")
            .field("dir", &self.dir)
            .field("names", &self.values.keys().collect::<Vec<_>>())
            .field("ignored", &self.ignored)
            .finish()
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> UnitSecretsError + '_ {
    move |e| UnitSecretsError::Io {
        path: path.to_path_buf(),
        what: iteron_policy::text::single_line_capped(&e.to_string(), 200),
    }
}

/// Owned by us or root, not writable by group or others.
fn check_owner_mode(path: &Path, meta: &std::fs::Metadata) -> Result<(), UnitSecretsError> {
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(UnitSecretsError::Unsafe {
            path: path.to_path_buf(),
            why: "owned by another user",
        });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(UnitSecretsError::Unsafe {
            path: path.to_path_buf(),
            why: "writable by group or others",
        });
    }
    Ok(())
}

impl UnitSecrets {
    /// The credentials of `$CREDENTIALS_DIRECTORY` when it is set (`None` when it is not).
    pub fn from_env(
        var: impl Fn(&str) -> Option<OsString>,
    ) -> Result<Option<UnitSecrets>, UnitSecretsError> {
        match var(VAR) {
            None => Ok(None),
            Some(dir) => UnitSecrets::load(Path::new(&dir)).map(Some),
        }
    }

    /// Read and check every credential in `dir`. The directory is resolved once and opened
    /// without following a final symbolic link; its entries are then listed and opened through
    /// that open directory (`/proc/self/fd`), so renaming or replacing the path meanwhile
    /// changes nothing that was checked.
    pub fn load(dir: &Path) -> Result<UnitSecrets, UnitSecretsError> {
        if !dir.is_absolute() {
            return Err(UnitSecretsError::NotAbsolute);
        }
        let meta = std::fs::symlink_metadata(dir).map_err(io(dir))?;
        if !meta.is_dir() {
            return Err(UnitSecretsError::Unsafe {
                path: dir.to_path_buf(),
                why: "not a directory (symbolic links are not followed)",
            });
        }
        let real = std::fs::canonicalize(dir).map_err(io(dir))?;
        let handle = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags((nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_NOFOLLOW).bits())
            .open(&real)
            .map_err(io(dir))?;
        let meta = handle.metadata().map_err(io(dir))?;
        check_owner_mode(dir, &meta)?;
        let via = PathBuf::from(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&handle)
        ));
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&via).map_err(io(dir))? {
            let entry = entry.map_err(io(dir))?;
            if names.len() == MAX_ENTRIES {
                return Err(UnitSecretsError::TooMany);
            }
            names.push(entry.file_name());
        }
        names.sort();
        let mut values = BTreeMap::new();
        let mut ignored = Vec::new();
        for name in names {
            let Some(var) = name.to_str().filter(|n| EnvName::parse(n).is_ok()) else {
                ignored.push(name.to_string_lossy().into_owned());
                continue;
            };
            // A credential never supplies what the broker strips from its own environment
            // (loader, proxy and TLS-root variables).
            if crate::sys::is_dangerous_env(var) {
                ignored.push(var.to_owned());
                continue;
            }
            values.insert(
                var.to_owned(),
                read_value(&via.join(&name), &real.join(&name))?,
            );
        }
        drop(handle);
        Ok(UnitSecrets {
            dir: real,
            values,
            ignored,
        })
    }

    /// The value of variable `name`, if a credential supplies it.
    pub fn get(&self, name: &str) -> Option<OsString> {
        self.values
            .get(name)
            .map(|v| OsString::from_vec(v.as_slice().to_vec()))
    }

    /// The directory they were read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The variable names supplied (never the values).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.values.keys().map(String::as_str)
    }

    /// Entries ignored: names that are not variable names, and variables the broker never
    /// forwards (loader, proxy, TLS roots). Names only, escaped for display.
    pub fn ignored(&self) -> &[String] {
        &self.ignored
    }
}

/// Read one value through `via` (a path below the open directory); errors name `shown`.
fn read_value(via: &Path, shown: &Path) -> Result<Zeroizing<Vec<u8>>, UnitSecretsError> {
    let unsafe_file = |why| UnitSecretsError::Unsafe {
        path: shown.to_path_buf(),
        why,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits())
        .open(via)
        .map_err(|e| {
            if e.raw_os_error() == Some(nix::libc::ELOOP) {
                unsafe_file("a symbolic link")
            } else {
                io(shown)(e)
            }
        })?;
    let meta = file.metadata().map_err(io(shown))?;
    if !meta.is_file() {
        return Err(unsafe_file("not a regular file"));
    }
    check_owner_mode(shown, &meta)?;
    if meta.len() > MAX_VALUE {
        return Err(unsafe_file("larger than 65536 bytes"));
    }
    // A buffer that never grows (a reallocation would leave an unzeroed copy behind): the size
    // seen, and one byte more to notice a file that grew since.
    let mut value = Zeroizing::new(vec![0u8; meta.len() as usize + 1]);
    let mut filled = 0;
    loop {
        let n = file.read(&mut value[filled..]).map_err(io(shown))?;
        if n == 0 {
            break;
        }
        filled += n;
        if filled == value.len() {
            return Err(unsafe_file("changed while it was read"));
        }
    }
    value.truncate(filled);
    if value.last() == Some(&b'\n') {
        value.pop();
    }
    if value.contains(&0) {
        return Err(unsafe_file("holds a NUL byte"));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("iteron-unit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o500 | 0o200)).unwrap();
        d
    }

    fn put(d: &Path, name: &str, value: &[u8], mode: u32) {
        let p = d.join(name);
        std::fs::write(&p, value).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn variable_named_credentials_are_read_and_others_ignored() {
        let d = dir("ok");
        put(&d, "GITHUB_TOKEN", b"ghp-canary-31c7\n", 0o400);
        put(&d, "API_KEY", b"two\nlines", 0o440);
        put(&d, "not-a-variable", b"x", 0o400);
        put(&d, "LD_PRELOAD", b"/tmp/evil.so", 0o400);
        let s = UnitSecrets::load(&d).unwrap();
        assert_eq!(s.get("LD_PRELOAD"), None);
        assert_eq!(
            s.get("GITHUB_TOKEN").unwrap(),
            OsString::from("ghp-canary-31c7")
        );
        assert_eq!(s.get("API_KEY").unwrap(), OsString::from("two\nlines"));
        assert_eq!(s.get("not-a-variable"), None);
        assert_eq!(s.get("OTHER"), None);
        assert_eq!(s.names().collect::<Vec<_>>(), ["API_KEY", "GITHUB_TOKEN"]);
        assert_eq!(s.ignored(), ["LD_PRELOAD", "not-a-variable"]);
        assert!(!format!("{s:?}").contains("canary"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn unsafe_directories_and_files_stop_the_start_without_quoting_a_value() {
        assert_eq!(
            UnitSecrets::load(Path::new("relative")).unwrap_err(),
            UnitSecretsError::NotAbsolute
        );
        type Make = fn(&Path);
        let cases: [(&str, Make); 6] = [
            ("group-writable", |d| put(d, "TOKEN", b"canary-1", 0o620)),
            ("symlink", |d| {
                put(d, "REAL", b"canary-2", 0o400);
                std::os::unix::fs::symlink(d.join("REAL"), d.join("LINK")).unwrap();
            }),
            ("nul", |d| put(d, "TOKEN", b"canary\0-3", 0o400)),
            ("oversize", |d| {
                put(d, "TOKEN", &vec![b'c'; MAX_VALUE as usize + 1], 0o400)
            }),
            ("subdir", |d| std::fs::create_dir(d.join("TOKEN")).unwrap()),
            ("dir-writable", |d| {
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).unwrap()
            }),
        ];
        for (name, make) in cases {
            let d = dir(name);
            make(&d);
            let e = UnitSecrets::load(&d).unwrap_err().to_string();
            assert!(!e.contains("canary") && !e.contains('\n'), "{name}: {e}");
            assert!(e.starts_with("credentials directory: "), "{name}: {e}");
            let _ = std::fs::remove_dir_all(&d);
        }
        // At the bound, and one byte over (a trailing newline is not counted twice).
        let d = dir("edge");
        put(&d, "TOKEN", &vec![b'c'; MAX_VALUE as usize], 0o400);
        assert_eq!(
            UnitSecrets::load(&d).unwrap().get("TOKEN").unwrap().len(),
            MAX_VALUE as usize
        );
        let _ = std::fs::remove_dir_all(&d);
        // Entries: the limit is read, one more is refused.
        let d = dir("many");
        for i in 0..MAX_ENTRIES {
            put(&d, &format!("V{i}"), b"v", 0o400);
        }
        assert_eq!(UnitSecrets::load(&d).unwrap().names().count(), MAX_ENTRIES);
        put(&d, "ONE_MORE", b"v", 0o400);
        assert_eq!(
            UnitSecrets::load(&d).unwrap_err(),
            UnitSecretsError::TooMany
        );
        let _ = std::fs::remove_dir_all(&d);
        iteron_test_support::record!(
            "P5",
            serde_json::json!({"max_value": MAX_VALUE, "max_entries": MAX_ENTRIES}),
        );
    }
}
