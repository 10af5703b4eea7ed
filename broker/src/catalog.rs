//! Discovery of skills and agent definitions: one immutable snapshot per run, read by the CLI
//! (`iteron skills`, `iteron agents`) and the broker alike.
//!
//! Where:
//! - trusted (operator-owned): `<home>/skills/<name>/SKILL.md`, `<home>/agents/*.md`;
//! - workspace input, never authority: `<repo>/.iteron/skills/<name>/SKILL.md`,
//!   `<repo>/.iteron/agents/*.md`.
//!
//! What is refused, each with a reported reason: a symlink anywhere on the path (never
//! followed), anything below a dependency/vendor directory ([`VENDOR_DIRS`]; the repository is
//! walked to find and report such `.iteron` directories), a `.iteron` directory that is not at
//! the repository root, files over their bounds, bidi or invisible characters, malformed
//! frontmatter. On a name collision the trusted entry wins and the other is reported as
//! shadowed. Hooks found in a repository configuration are reported and ignored.
//!
//! Skill bodies are loaded on demand ([`Catalog::skill_body`]): the file is read again and must
//! still have the SHA-256 it had at discovery, so the agent never gets a body the index did not
//! describe.
#![forbid(unsafe_code)]

use std::fs;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use iteron_policy::agentdef::{self, AgentDef, Tier};
use iteron_policy::skill;
use iteron_policy::text;

/// Directory names whose contents are dependencies or vendored code, never definitions.
pub const VENDOR_DIRS: &[&str] = &[
    "node_modules",
    "bower_components",
    "jspm_packages",
    "vendor",
    "third_party",
    "third-party",
    "target",
    ".venv",
    "venv",
    "site-packages",
    "dist-packages",
    "__pypackages__",
    ".tox",
    ".bundle",
    "Pods",
    "Carthage",
    ".cargo",
    ".gradle",
];

/// Most directory entries the repository walk looks at.
pub const MAX_WALK_ENTRIES: usize = 1_000_000;
/// Deepest directory level the walk descends to.
pub const MAX_WALK_DEPTH: usize = 48;
/// Largest repository configuration read to look for hooks.
pub const MAX_REPO_CONFIG: u64 = 1 << 20;
/// Most rejections reported (the rest are counted).
pub const MAX_REJECTED: usize = 1000;

/// A skill in the index.
#[derive(Debug, Clone)]
pub struct SkillEntry {
    /// Its name.
    pub name: String,
    /// Its description.
    pub description: String,
    /// Its tier.
    pub tier: Tier,
    /// The `SKILL.md`.
    pub path: PathBuf,
    sha256: [u8; 32],
}

/// An admitted agent definition.
#[derive(Debug, Clone)]
pub struct AgentEntry {
    /// The definition.
    pub def: AgentDef,
    /// Its file.
    pub path: PathBuf,
}

/// What a refused thing was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    /// A skill.
    Skill,
    /// An agent definition.
    Agent,
    /// Something that concerns both (a repository configuration, the walk itself).
    Other,
}

/// Most agent definitions admitted (trusted first); more are refused with a reason.
pub const MAX_AGENTS: usize = 256;
/// Largest snapshot handed to the operator (`catalog`), in bytes of JSON: entries past it are
/// left out and counted, so the answer always fits in a frame.
pub const MAX_SNAPSHOT_BYTES: usize = 768 * 1024;

/// Something found and refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The path (terminal-safe).
    pub path: String,
    /// Why.
    pub reason: String,
    /// What it was.
    pub kind: RejectKind,
}

/// The snapshot.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// The skill index (trusted first), at most [`skill::MAX_INDEX`].
    pub skills: Vec<SkillEntry>,
    /// Admitted agent definitions (trusted first).
    pub agents: Vec<AgentEntry>,
    /// Everything refused, with reasons.
    pub rejected: Vec<Rejected>,
    /// Rejections beyond [`MAX_REJECTED`].
    pub rejected_more: usize,
    /// The repository discovered, as given (resolved when it could be).
    pub repo: Option<PathBuf>,
}

fn shown(p: &Path) -> String {
    text::single_line_capped(&p.to_string_lossy(), 300)
}

fn vendor_component(p: &Path, base: &Path) -> Option<String> {
    p.strip_prefix(base).ok()?.components().find_map(|c| {
        let s = c.as_os_str().to_str()?;
        VENDOR_DIRS.contains(&s).then(|| s.to_owned())
    })
}

/// Read a regular file (never through a symlink), at most `max` bytes.
fn read_plain(path: &Path, max: usize) -> Result<Vec<u8>, String> {
    // O_NONBLOCK: a FIFO planted where a file was expected must not block the broker in open;
    // it is then refused as not a regular file.
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(
            (nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_NONBLOCK
                | nix::fcntl::OFlag::O_NOCTTY)
                .bits(),
        )
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(nix::libc::ELOOP) {
                "a symlink (symlinks are never followed)".to_owned()
            } else {
                format!("cannot be read: {}", e.kind())
            }
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot be read: {}", e.kind()))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > max as u64 {
        return Err(format!("over the size bound of {max} bytes"));
    }
    let mut out = Vec::new();
    file.take(max as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("cannot be read: {}", e.kind()))?;
    if out.len() > max {
        return Err(format!("over the size bound of {max} bytes"));
    }
    Ok(out)
}

/// What a path is, without following a symlink.
enum Kind {
    Missing,
    Dir,
    File,
    Symlink,
    Other,
}

fn kind(p: &Path) -> Kind {
    match fs::symlink_metadata(p) {
        Err(_) => Kind::Missing,
        Ok(m) if m.file_type().is_symlink() => Kind::Symlink,
        Ok(m) if m.is_dir() => Kind::Dir,
        Ok(m) if m.is_file() => Kind::File,
        Ok(_) => Kind::Other,
    }
}

struct Builder {
    cat: Catalog,
    kind: RejectKind,
}

impl Builder {
    fn reject(&mut self, path: &Path, reason: impl Into<String>) {
        let kind = self.kind;
        self.reject_as(kind, path, reason);
    }

    fn reject_as(&mut self, kind: RejectKind, path: &Path, reason: impl Into<String>) {
        if self.cat.rejected.len() >= MAX_REJECTED {
            self.cat.rejected_more += 1;
            return;
        }
        self.cat.rejected.push(Rejected {
            path: shown(path),
            reason: text::single_line_capped(&reason.into(), 300),
            kind,
        });
    }

    /// Whether a path of the trusted tier is the operator's and not writable by others;
    /// reports it when not.
    fn trusted_path(&mut self, p: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        match fs::symlink_metadata(p) {
            Ok(m) if m.uid() != nix::unistd::geteuid().as_raw() || m.mode() & 0o022 != 0 => {
                self.reject(
                    p,
                    "not owned by the operator, or writable by group or others; a trusted file must be the operator's alone",
                );
                false
            }
            _ => true,
        }
    }

    /// The operator's own directories must be theirs and not writable by anyone else: a
    /// trusted tier that others can write is not trusted.
    fn operator_owned(&mut self, dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(m) = fs::symlink_metadata(dir) else {
            return true;
        };
        if m.file_type().is_symlink() {
            return true; // reported by `entries`
        }
        if m.uid() != nix::unistd::geteuid().as_raw() || m.mode() & 0o022 != 0 {
            self.reject(
                dir,
                "not owned by the operator, or writable by group or others; the trusted tier is skipped",
            );
            return false;
        }
        true
    }

    /// Sorted entries of a directory that must itself be a real directory.
    fn entries(&mut self, dir: &Path) -> Vec<PathBuf> {
        match kind(dir) {
            Kind::Missing => return Vec::new(),
            Kind::Dir => {}
            Kind::Symlink => {
                self.reject(dir, "a symlink (symlinks are never followed)");
                return Vec::new();
            }
            _ => {
                self.reject(dir, "not a directory");
                return Vec::new();
            }
        }
        let mut out: Vec<PathBuf> = match fs::read_dir(dir) {
            Ok(rd) => rd.flatten().map(|e| e.path()).collect(),
            Err(e) => {
                self.reject(dir, format!("cannot be listed: {}", e.kind()));
                return Vec::new();
            }
        };
        out.sort();
        out
    }

    fn skills_in(&mut self, dir: &Path, tier: Tier) {
        self.kind = RejectKind::Skill;
        if tier == Tier::User && !self.operator_owned(dir) {
            return;
        }
        for sub in self.entries(dir) {
            let name = sub
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            match kind(&sub) {
                Kind::Dir => {}
                Kind::Symlink => {
                    self.reject(&sub, "a symlink (symlinks are never followed)");
                    continue;
                }
                _ => {
                    self.reject(&sub, "not a skill directory (expected <name>/SKILL.md)");
                    continue;
                }
            }
            if VENDOR_DIRS.contains(&name.as_str()) {
                self.reject(
                    &sub,
                    format!("inside a dependency/vendor directory ({name})"),
                );
                continue;
            }
            let file = sub.join("SKILL.md");
            if tier == Tier::User && !(self.trusted_path(&sub) && self.trusted_path(&file)) {
                continue;
            }
            let bytes = match read_plain(&file, skill::MAX_FILE) {
                Ok(b) => b,
                Err(why) => {
                    self.reject(&file, why);
                    continue;
                }
            };
            let parsed = match skill::parse(&bytes, &name) {
                Ok(s) => s,
                Err(e) => {
                    self.reject(&file, e.to_string());
                    continue;
                }
            };
            if let Some(prior) = self.cat.skills.iter().find(|s| s.name == parsed.name) {
                let reason = format!(
                    "shadowed by the {} skill of the same name",
                    prior.tier.as_str()
                );
                self.reject(&file, reason);
                continue;
            }
            if self.cat.skills.len() >= skill::MAX_INDEX {
                self.reject(
                    &file,
                    format!("the skill index is full ({} entries)", skill::MAX_INDEX),
                );
                continue;
            }
            self.cat.skills.push(SkillEntry {
                name: parsed.name,
                description: parsed.description,
                tier,
                path: file,
                sha256: Sha256::digest(&bytes).into(),
            });
        }
    }

    fn agents_in(&mut self, dir: &Path, tier: Tier) {
        self.kind = RejectKind::Agent;
        if tier == Tier::User && !self.operator_owned(dir) {
            return;
        }
        for file in self.entries(dir) {
            if file.extension().is_none_or(|e| e != "md") {
                continue;
            }
            if tier == Tier::User && !self.trusted_path(&file) {
                continue;
            }
            let bytes = match read_plain(&file, agentdef::MAX_FILE) {
                Ok(b) => b,
                Err(why) => {
                    self.reject(&file, why);
                    continue;
                }
            };
            let def = match agentdef::parse(&bytes, tier) {
                Ok(d) => d,
                Err(e) => {
                    self.reject(&file, e.to_string());
                    continue;
                }
            };
            if let Some(prior) = self.cat.agents.iter().find(|a| a.def.name == def.name) {
                let reason = if prior.def.tier == tier {
                    "duplicate name in the same directory".to_owned()
                } else {
                    format!(
                        "shadowed by the {} definition of the same name",
                        prior.def.tier.as_str()
                    )
                };
                self.reject(&file, reason);
                continue;
            }
            if self.cat.agents.len() >= MAX_AGENTS {
                self.reject(
                    &file,
                    format!("the agent index is full ({MAX_AGENTS} entries)"),
                );
                continue;
            }
            self.cat.agents.push(AgentEntry { def, path: file });
        }
    }

    /// Walk the repository (no symlinks followed, `.git` skipped) and report every `.iteron`
    /// directory that is not the root one, naming why it is ignored.
    fn walk_repo(&mut self, repo: &Path) {
        self.kind = RejectKind::Other;
        let mut stack = vec![(repo.to_path_buf(), 0usize)];
        let mut seen = 0usize;
        while let Some((dir, depth)) = stack.pop() {
            let Ok(rd) = fs::read_dir(&dir) else { continue };
            for entry in rd.flatten() {
                seen += 1;
                if seen > MAX_WALK_ENTRIES {
                    self.reject(
                        repo,
                        format!("the repository walk stopped after {MAX_WALK_ENTRIES} entries"),
                    );
                    return;
                }
                let Ok(ft) = entry.file_type() else { continue };
                if !ft.is_dir() {
                    continue;
                }
                let name = entry.file_name();
                if name == ".git" {
                    continue;
                }
                let path = entry.path();
                if name == ".iteron" && dir != repo {
                    self.report_nested(repo, &path);
                    continue;
                }
                if depth + 1 < MAX_WALK_DEPTH && !(name == ".iteron" && dir == repo) {
                    stack.push((path, depth + 1));
                }
            }
        }
    }

    fn report_nested(&mut self, repo: &Path, dot: &Path) {
        let why = match vendor_component(dot, repo) {
            Some(v) => format!("inside a dependency/vendor directory ({v}); stripped"),
            None => "not at the repository root; ignored".to_owned(),
        };
        let mut found = false;
        for (sub, pattern, kind) in [
            ("skills", "SKILL.md", RejectKind::Skill),
            ("agents", ".md", RejectKind::Agent),
        ] {
            let Ok(rd) = fs::read_dir(dot.join(sub)) else {
                continue;
            };
            let mut paths: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            paths.sort();
            for p in paths {
                let target = if pattern == "SKILL.md" {
                    p.join("SKILL.md")
                } else {
                    p.clone()
                };
                if pattern == ".md" && p.extension().is_none_or(|e| e != "md") {
                    continue;
                }
                found = true;
                self.reject_as(kind, &target, why.clone());
            }
        }
        if !found {
            self.reject(dot, why);
        }
    }

    fn repo_config(&mut self, repo: &Path) {
        self.kind = RejectKind::Other;
        let path = repo.join(".iteron").join("config.json");
        match kind(&path) {
            Kind::Missing => {}
            Kind::Symlink => self.reject(&path, "a symlink (symlinks are never followed)"),
            _ => {
                let Ok(bytes) = read_plain(&path, MAX_REPO_CONFIG as usize) else {
                    self.reject(
                        &path,
                        "a repository configuration is never read as authority",
                    );
                    return;
                };
                let has_hooks = serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .is_some_and(|v| v.get("hooks").is_some());
                if has_hooks {
                    self.reject(
                        &path,
                        "hooks in a repository are ignored (hooks load only from ~/.iteron/config.json)",
                    );
                } else {
                    self.reject(&path, "a repository configuration is ignored (configuration loads only from ~/.iteron)");
                }
            }
        }
    }
}

/// Discover everything under `home` (trusted) and, if given, `repo` (workspace input).
pub fn discover(home: &Path, repo: Option<&Path>) -> Catalog {
    let mut b = Builder {
        cat: Catalog::default(),
        kind: RejectKind::Other,
    };
    b.skills_in(&home.join("skills"), Tier::User);
    b.agents_in(&home.join("agents"), Tier::User);
    if let Some(repo) = repo {
        let dot = repo.join(".iteron");
        match kind(&dot) {
            Kind::Symlink => b.reject_as(
                RejectKind::Other,
                &dot,
                "a symlink (symlinks are never followed)",
            ),
            Kind::Dir => {
                b.skills_in(&dot.join("skills"), Tier::Repository);
                b.agents_in(&dot.join("agents"), Tier::Repository);
                b.repo_config(repo);
            }
            _ => {}
        }
        b.walk_repo(repo);
        b.cat.repo = Some(std::fs::canonicalize(repo).unwrap_or_else(|_| repo.to_path_buf()));
    }
    b.cat
}

/// Why a skill body could not be given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UseSkillError {
    /// No skill of that name in the index.
    Unknown,
    /// The file changed (or vanished) since discovery.
    Changed,
}

impl Catalog {
    /// The body of an indexed skill, read now and checked against the discovery digest.
    pub fn skill_body(&self, name: &str) -> Result<(&SkillEntry, String), UseSkillError> {
        let entry = self
            .skills
            .iter()
            .find(|s| s.name == name)
            .ok_or(UseSkillError::Unknown)?;
        let bytes = read_plain(&entry.path, skill::MAX_FILE).map_err(|_| UseSkillError::Changed)?;
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        if digest != entry.sha256 {
            return Err(UseSkillError::Changed);
        }
        let dir = entry
            .path
            .parent()
            .and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parsed = skill::parse(&bytes, &dir).map_err(|_| UseSkillError::Changed)?;
        Ok((entry, parsed.body))
    }

    /// The agent definition with exactly this name.
    pub fn agent(&self, name: &str) -> Option<&AgentEntry> {
        self.agents.iter().find(|a| a.def.name == name)
    }

    /// The whole snapshot, as a running broker hands it to the operator (`catalog`) and as the
    /// CLI renders it: the repository (shown, and the SHA-256 of its resolved path, to compare
    /// exactly), the skills, the agents and one list of rejections with their kind. At most
    /// [`MAX_SNAPSHOT_BYTES`] of entries: past that, rejections and then agents and skills are
    /// left out and counted in `omitted`.
    pub fn snapshot_json(&self) -> Value {
        use std::os::unix::ffi::OsStrExt;
        let mut budget = MAX_SNAPSHOT_BYTES;
        let mut omitted = 0usize;
        let mut take = |v: Value, out: &mut Vec<Value>| {
            let size = serde_json::to_vec(&v).map_or(usize::MAX, |b| b.len());
            if size <= budget {
                budget -= size;
                out.push(v);
            } else {
                omitted += 1;
            }
        };
        let mut skills = Vec::new();
        for s in &self.skills {
            take(
                json!({"name": s.name, "tier": s.tier.as_str(), "description": s.description, "path": shown(&s.path)}),
                &mut skills,
            );
        }
        let mut agents = Vec::new();
        for a in &self.agents {
            take(agent_json(&a.def, Some(&a.path)), &mut agents);
        }
        let mut rejected = Vec::new();
        for r in &self.rejected {
            let kind = match r.kind {
                RejectKind::Skill => "skill",
                RejectKind::Agent => "agent",
                RejectKind::Other => "other",
            };
            take(
                json!({"path": r.path, "reason": r.reason, "kind": kind}),
                &mut rejected,
            );
        }
        json!({
            "repo": self.repo.as_deref().map(shown),
            "repo_sha256": self.repo.as_deref().map(|r| crate::audit::sha256_hex(r.as_os_str().as_bytes())),
            "skills": skills,
            "agents": agents,
            "rejected": rejected,
            "rejected_more": self.rejected_more,
            "omitted": omitted,
        })
    }
}

/// One definition as shown (the operator's view and the broker's `resolve_agent`).
pub fn agent_json(d: &AgentDef, path: Option<&Path>) -> Value {
    let mut v = json!({
        "name": d.name,
        "tier": d.tier.as_str(),
        "identity": d.identity,
        "description": d.description,
        "tools": d.tools,
        "model": match &d.model {
            agentdef::ModelPolicy::Inherit => "inherit".to_owned(),
            agentdef::ModelPolicy::Route(r) => text::single_line_capped(r, 200),
        },
        "budget": {
            "max_turns": d.budget.max_turns,
            "max_wall_secs": d.budget.max_wall_secs,
            "max_consecutive_tool_errors": d.budget.max_consecutive_tool_errors,
            "max_tokens": d.budget.max_tokens,
            "max_usd_micros": d.budget.max_usd_micros,
        },
    });
    if let (Some(p), Some(obj)) = (path, v.as_object_mut()) {
        obj.insert("path".into(), shown(p).into());
    }
    v
}
