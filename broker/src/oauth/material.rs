//! Secret material the operator names by path (`oauth.client_key_file`): read when it is needed,
//! bounded, and only from a file nobody else could have written or read.
//!
//! A key file must be a regular file (a symbolic link is not followed), owned by the broker's
//! uid or root, with no group or other permission bit, and at most the caller's bound. The
//! error names the rule and the path, never the content.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use zeroize::Zeroizing;

/// What both kinds of file must be: a regular file owned by the broker's uid or root, with none
/// of the `forbidden` mode bits (`why` says what they allow). Its length, for the read.
fn check_owned(
    file: &std::fs::File,
    forbidden: u32,
    why: &str,
    shown: &std::path::Display<'_>,
) -> Result<u64, String> {
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot be inspected ({}): {shown}", e.kind()))?;
    if !meta.is_file() {
        return Err(format!("not a regular file: {shown}"));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(format!("owned by another user: {shown}"));
    }
    if meta.mode() & forbidden != 0 {
        return Err(format!("{why}: {shown}"));
    }
    Ok(meta.len())
}

/// Read a private file (see the module documentation) of at most `max` bytes.
pub fn read_private_file(path: &Path, max: usize) -> Result<Zeroizing<Vec<u8>>, String> {
    let shown = path.display();
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits())
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(nix::libc::ELOOP) {
                format!("it is a symbolic link (not followed): {shown}")
            } else {
                format!("cannot be opened ({}): {shown}", e.kind())
            }
        })?;
    let len = check_owned(
        &file,
        0o077,
        "readable or writable by group or others (chmod 600)",
        &shown,
    )?;
    read_bounded(&mut file, len, max, &shown.to_string())
}

/// Read a file the operator named that may be shared but not tampered with (a workload's
/// identity token, which a runtime such as Kubernetes projects through symbolic links and
/// rotates): the final target must be a regular file owned by the broker's uid or root and
/// writable by nobody else; at most `max` bytes. Symbolic links are followed.
pub fn read_shared_file(path: &Path, max: usize) -> Result<Zeroizing<Vec<u8>>, String> {
    let shown = path.display();
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(path)
        .map_err(|e| format!("cannot be opened ({}): {shown}", e.kind()))?;
    let len = check_owned(&file, 0o022, "writable by group or others", &shown)?;
    read_bounded(&mut file, len, max, &shown.to_string())
}

/// Read at most `max` bytes into a buffer that never grows (a reallocation would leave an
/// unzeroed copy): the size seen and one byte more, to notice a file that grew since.
fn read_bounded(
    file: &mut std::fs::File,
    size: u64,
    max: usize,
    shown: &str,
) -> Result<Zeroizing<Vec<u8>>, String> {
    let len = usize::try_from(size).unwrap_or(usize::MAX);
    if len > max {
        return Err(format!("larger than {max} bytes: {shown}"));
    }
    let mut buf = Zeroizing::new(vec![0u8; len + 1]);
    let mut filled = 0;
    loop {
        let n = file
            .read(&mut buf[filled..])
            .map_err(|e| format!("cannot be read ({}): {shown}", e.kind()))?;
        if n == 0 {
            break;
        }
        filled += n;
        if filled > len {
            return Err(format!("it grew while being read: {shown}"));
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_a_private_regular_file_within_the_bound_is_read() {
        let dir = std::env::temp_dir().join(format!("iteron-material-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key.pem");
        std::fs::write(&f, b"0123456789").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_private_file(&f, 10).unwrap().as_slice(), b"0123456789");
        let e = read_private_file(&f, 9).unwrap_err();
        assert!(e.starts_with("larger than 9 bytes"), "{e}");
        for mode in [0o640, 0o604, 0o660] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = read_private_file(&f, 10).unwrap_err();
            assert!(e.contains("group or others"), "{mode:o}: {e}");
            assert!(!e.contains("0123456789"));
        }
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert!(read_private_file(&f, 10).is_ok());
        let link = dir.join("link.pem");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        assert!(
            read_private_file(&link, 10)
                .unwrap_err()
                .contains("symbolic link")
        );
        assert!(
            read_private_file(&dir, 10)
                .unwrap_err()
                .contains("not a regular file")
        );
        assert!(
            read_private_file(&dir.join("missing"), 10)
                .unwrap_err()
                .contains("cannot be opened")
        );
        // A shared file (an identity token) may be read by others and reached through a
        // link, but never written by them.
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(
            read_shared_file(&link, 10).unwrap().as_slice(),
            b"0123456789"
        );
        assert!(
            read_shared_file(&link, 9)
                .unwrap_err()
                .starts_with("larger than 9 bytes")
        );
        for mode in [0o664, 0o646] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            assert!(
                read_shared_file(&link, 10)
                    .unwrap_err()
                    .contains("writable by group or others")
            );
        }
        assert!(
            read_shared_file(&dir, 10)
                .unwrap_err()
                .contains("not a regular file")
        );
        let _ = std::fs::remove_dir_all(&dir);
        iteron_test_support::record!(
            "P16",
            serde_json::json!({"modes_refused": ["640", "604", "660"], "symlink": "refused"}),
        );
    }
}
