//! A child's environment: values kept secret, names only in diagnostics, and the program
//! looked up on the child's own `PATH`.
#![forbid(unsafe_code)]

use super::*;

/// The value of an environment variable given to a child: possibly a secret, so it lives in a
/// zeroizing box, is never `Debug`-printed, and is exposed only to `exec`.
pub struct EnvValue(secrecy::SecretBox<Vec<u8>>);

impl EnvValue {
    /// Take ownership of a value.
    pub fn new(value: OsString) -> EnvValue {
        use std::os::unix::ffi::OsStringExt;
        EnvValue(secrecy::SecretBox::new(Box::new(value.into_vec())))
    }

    /// The value, for `exec` (and tests).
    pub fn expose(&self) -> &OsStr {
        use secrecy::ExposeSecret;
        OsStr::from_bytes(self.0.expose_secret())
    }
}

impl Clone for EnvValue {
    fn clone(&self) -> Self {
        use secrecy::ExposeSecret;
        EnvValue(secrecy::SecretBox::new(Box::new(
            self.0.expose_secret().clone(),
        )))
    }
}

impl fmt::Debug for EnvValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[value not shown]")
    }
}

impl From<&str> for EnvValue {
    fn from(s: &str) -> Self {
        EnvValue::new(OsString::from(s))
    }
}

/// An environment variable for a child: its name and its (secret) value.
pub type EnvVar = (OsString, EnvValue);

/// Build a child's environment from nothing: `PATH` (the operator's, else [`SAFE_PATH`]),
/// `LANG`, then each named variable that is set in `lookup` (the broker's environment). Names
/// not set are reported back so diagnostics can say so; their absence is not an error.
/// Pure: the caller passes the lookup, so tests never touch the process environment.
pub fn child_env(
    named: &[EnvName],
    path: Option<&str>,
    lookup: impl Fn(&str) -> Option<OsString>,
) -> (Vec<EnvVar>, Vec<EnvName>) {
    let mut env: Vec<EnvVar> = vec![
        ("PATH".into(), path.unwrap_or(SAFE_PATH).into()),
        ("LANG".into(), CHILD_LANG.into()),
    ];
    let mut missing = Vec::new();
    for name in named {
        match lookup(name.as_str()) {
            Some(value) => {
                // A named variable replaces a base one (the operator chose it explicitly).
                env.retain(|(k, _)| k.as_os_str() != OsStr::new(name.as_str()));
                env.push((name.as_str().into(), EnvValue::new(value)));
            }
            None => missing.push(name.clone()),
        }
    }
    (env, missing)
}

/// Find a bare program name on `path` (the child's `PATH`): the first regular, executable file.
pub fn resolve_program(command: &str, path: &str) -> Option<PathBuf> {
    if command.starts_with('/') {
        return Some(PathBuf::from(command));
    }
    path.split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join(command))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Render an environment variable name list for diagnostics.
pub fn names_of(env: &[EnvVar]) -> Vec<String> {
    env.iter()
        .map(|(k, _)| String::from_utf8_lossy(k.as_bytes()).into_owned())
        .collect()
}
