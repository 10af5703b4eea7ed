//! Benchmark: skill and agent-definition discovery over a synthetic repository of 100,000
//! files, most of them in dependency trees (`node_modules`, `vendor`, `target`), with a
//! `.iteron` directory holding 20 skills and 20 agent definitions and one vendored `.iteron`
//! to report. Compared, in the same run, with a bare recursive directory walk of the same tree
//! (std `read_dir`, no symlink following) — the floor any discovery that looks at every
//! directory must pay.
//!
//! Run: `cargo bench -p iteron-broker --bench catalog` (`-- --write-docs` regenerates the table
//! in docs/benchmarks.md).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark harness: any failure should abort loudly"
)]

use std::path::{Path, PathBuf};
use std::time::Instant;

#[path = "common/docs.rs"]
mod docs;

const FILES: usize = 100_000;
const RUNS: usize = 15;
const START: &str = "<!-- bench:catalog:start -->";
const END: &str = "<!-- bench:catalog:end -->";

fn build(root: &Path) -> usize {
    let n = std::cell::Cell::new(0usize);
    let write = |p: PathBuf, text: &str| {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
        n.set(n.get() + 1);
    };
    for i in 0..20 {
        write(
            root.join(format!(".iteron/skills/skill{i}/SKILL.md")),
            &format!("---\nname: skill{i}\ndescription: Skill number {i}.\n---\nDo step {i}.\n"),
        );
        write(
            root.join(format!(".iteron/agents/agent{i}.md")),
            &format!(
                "---\nname: agent{i}\ntools: [read_file, grep]\nmaxTurns: 10\n---\nAgent {i}.\n"
            ),
        );
    }
    write(
        root.join("node_modules/pkg0/.iteron/skills/x/SKILL.md"),
        "---\nname: x\ndescription: vendored\n---\nx\n",
    );
    // Source files: 10% in src/, the rest in dependency trees, 50 files per directory.
    let mut i = 0;
    while n.get() < FILES {
        let tree = match i % 10 {
            0 => "src".to_owned(),
            1..=6 => format!("node_modules/pkg{}", i % 500),
            7 | 8 => format!("vendor/lib{}", i % 200),
            _ => format!("target/debug/deps{}", i % 100),
        };
        let dir = root.join(format!("{tree}/d{}", i / 10));
        for f in 0..50 {
            write(dir.join(format!("f{f}.txt")), "x");
        }
        i += 1;
    }
    n.get()
}

fn bare_walk(root: &Path) -> usize {
    let mut stack = vec![root.to_path_buf()];
    let mut n = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            n += 1;
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    n
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let write_docs = std::env::args().any(|a| a == "--write-docs");
    let base = std::env::temp_dir().join(format!("iteron-bench-catalog-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let repo = base.join("repo");
    let home = base.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let files = build(&repo);
    // Warm the page cache for both.
    let entries = bare_walk(&repo);
    let cat = iteron_broker::catalog::discover(&home, Some(&repo));
    assert_eq!((cat.skills.len(), cat.agents.len()), (20, 20));
    assert_eq!(cat.rejected.len(), 1);
    let mut walk = Vec::new();
    let mut disc = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        std::hint::black_box(bare_walk(&repo));
        walk.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(iteron_broker::catalog::discover(&home, Some(&repo)));
        disc.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (w, d) = (median(walk), median(disc));
    let _ = std::fs::remove_dir_all(&base);
    let table = format!(
        "{files} files ({entries} directory entries), {RUNS} runs each, warm page cache.\n\n\
         | what | median |\n|---|---|\n\
         | `catalog::discover` (20 skills, 20 agents, 1 vendored `.iteron` reported) | {d:.1} ms |\n\
         | bare recursive `read_dir` walk of the same tree | {w:.1} ms |\n\
         | ratio discovery / bare walk | {:.2}× |\n\n\
         Target: ≤ 100 ms for skills plus agents.",
        d / w
    );
    println!("{table}");
    if write_docs {
        docs::write_table(START, END, &table);
    }
}
