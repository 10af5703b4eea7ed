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
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "readable or writable by group or others (chmod 600): {shown}"
        ));
    }
    let len = usize::try_from(meta.len()).unwrap_or(usize::MAX);
    if len > max {
        return Err(format!("larger than {max} bytes: {shown}"));
    }
    // A buffer that never grows (a reallocation would leave an unzeroed copy): the size seen
    // and one byte more, to notice a file that grew since.
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
        let _ = std::fs::remove_dir_all(&dir);
        crate::test_report::record(
            "P16",
            "broker/src/oauth/material.rs::only_a_private_regular_file_within_the_bound_is_read",
            serde_json::json!({"modes_refused": ["640", "604", "660"], "symlink": "refused"}),
        );
    }
}
