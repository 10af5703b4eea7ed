//! The tokio runtimes the commands use: one shape each, built in one place.

use crate::error::CliError;

/// Two worker threads (network probes, logins, the broker).
pub(crate) fn multi_thread() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Output)
}

/// One thread (socket clients).
pub(crate) fn current_thread() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Output)
}
