//! Test directories and the files the tests write into an operator home or read from it.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::procs::{CHILD_UID, is_root};

/// Copy a directory tree (regular files and directories only); directories become `dir_mode`,
/// files `file_mode`.
pub fn copy_tree(from: &Path, to: &Path, dir_mode: u32, file_mode: u32) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(dir_mode)).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &t, dir_mode, file_mode);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
            std::fs::set_permissions(&t, std::fs::Permissions::from_mode(file_mode)).unwrap();
        }
    }
}

/// Under a root test run, hand `p` to uid 65534: confined children (servers and hooks) run as
/// that uid, so a directory they must write is theirs (Landlock still decides where they may).
pub fn give_to_children(p: &Path) {
    if is_root() {
        std::os::unix::fs::chown(p, Some(CHILD_UID), Some(CHILD_UID)).unwrap();
    }
}

/// A test's own directory, `<temp>/<prefix>-<name>-<pid>`, made anew: the directory itself
/// 0755 (so uid 65534 can reach the socket directory a broker makes in it, where a test lets
/// it) holding the operator's `home` (0700). The caller removes it.
pub fn private_area(prefix: &str, name: &str) -> PathBuf {
    let base = std::env::temp_dir().join(format!("{prefix}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(&base)
        .unwrap();
    // The umask may have taken bits from the mode asked for.
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(base.join("home"))
        .unwrap();
    base
}

/// Write `value` as pretty-printed JSON to `path` with mode 0600, the mode the broker demands
/// of its configuration.
pub fn write_private_json(path: &Path, value: &Value) {
    std::fs::write(path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Every audit record of the operator home `home`: the lines of its `audit/*.jsonl` files, the
/// files in name order.
pub fn audit_records(home: &Path) -> Vec<Value> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(home.join("audit"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        for line in std::fs::read_to_string(f).unwrap().lines() {
            out.push(serde_json::from_str(line).unwrap());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn an_area_is_0755_with_a_0700_home_and_a_config_is_0600() {
        let base = private_area("iteron-support", "modes");
        std::fs::write(base.join("leftover"), "x").unwrap();
        // Made anew: what an earlier run left is gone.
        let base = private_area("iteron-support", "modes");
        assert!(!base.join("leftover").exists());
        assert_eq!(std::fs::metadata(&base).unwrap().mode() & 0o7777, 0o755);
        let home = base.join("home");
        assert_eq!(std::fs::metadata(&home).unwrap().mode() & 0o7777, 0o700);
        let config = home.join("config.json");
        write_private_json(&config, &serde_json::json!({"schema_version": 2}));
        assert_eq!(std::fs::metadata(&config).unwrap().mode() & 0o7777, 0o600);
        assert_eq!(
            std::fs::read_to_string(&config).unwrap(),
            "{\n  \"schema_version\": 2\n}"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn audit_records_are_read_in_file_order_and_other_files_are_ignored() {
        let base = private_area("iteron-support", "audit");
        let audit = base.join("home").join("audit");
        std::fs::create_dir(&audit).unwrap();
        std::fs::write(audit.join("2026-01-02.jsonl"), "{\"seq\":3}\n").unwrap();
        std::fs::write(audit.join("2026-01-01.jsonl"), "{\"seq\":1}\n{\"seq\":2}\n").unwrap();
        std::fs::write(audit.join("head"), "not a record").unwrap();
        let seqs: Vec<u64> = audit_records(&base.join("home"))
            .iter()
            .map(|r| r["seq"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, [1, 2, 3]);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
