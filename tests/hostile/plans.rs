//! Hostile inputs: plans and checkpoints (see main.rs).
//!
//! A valid plan is made with the CLI (the MLP on a 2x2 mesh, SGD), then its JSON is edited one
//! class at a time; every edit must be refused before any rank starts, so none of them can panic
//! a rank's thread or make collectives wait for each other until the timeout (the runs below keep
//! the default timeout of 600 s: a hang would hit the test's time cap). Checkpoints are written by
//! a real run, then damaged in ways their CRCs do not catch.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::common::*;

/// The plan's feeds: the MLP's input and the MSE loss's target.
fn feeds() -> Vec<String> {
    let x = data("models/mlp.x.npy").display().to_string();
    let t = data("refgrad/mlp/mlp.target.npy").display().to_string();
    vec!["--feed".into(), format!("x={x}"), "--feed".into(), format!("target={t}")]
}

/// Plans the MLP on 2x2 with SGD into `dir/plan.json` (with `strategy`: auto, dp, ...).
fn plan(dir: &Path, strategy: &str) -> PathBuf {
    let out = dir.join(format!("plan-{strategy}.json"));
    let mlp = model("mlp.onnx");
    let o = out.display().to_string();
    ok(&[
        "plan",
        &mlp,
        "--mesh",
        "2x2",
        "--memory",
        "4GiB",
        "--loss",
        "mse:y:target",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--time-limit",
        "1",
        "--strategy",
        strategy,
        "-o",
        &o,
    ]);
    out
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).expect("reading JSON")).expect("parsing JSON")
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_string_pretty(v).expect("JSON")).expect("writing JSON");
}

/// `autopar run PLAN --feed ... extra...`, expected to fail with every phrase.
fn run_fails(plan: &Path, extra: &[&str], phrases: &[&str]) -> String {
    let p = plan.display().to_string();
    let mut args: Vec<String> = vec!["run".into(), p];
    args.extend(feeds());
    args.extend(extra.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    fails(&argv, phrases)
}

fn run_ok(plan: &Path, extra: &[&str]) -> String {
    let p = plan.display().to_string();
    let mut args: Vec<String> = vec!["run".into(), p];
    args.extend(feeds());
    args.extend(extra.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&argv)
}

/// Sets the learning rate of the graph's SGD updates (the JSON form's attribute), and with
/// `rehash` the model hash to match (`ModelInfo::hash`), so the edit reaches the checks behind
/// the hash check.
fn set_lr(p: &mut Value, lr: Value, rehash: bool) {
    for n in p["graph"]["nodes"].as_array_mut().expect("graph nodes") {
        if let Some(a) = n["op"].get_mut("sgd_update") {
            a["lr"] = lr.clone();
        }
    }
    if rehash {
        let g: ir::Graph = serde_json::from_value(p["graph"].clone()).expect("the edited graph reads");
        p["model"]["hash"] = json!(g.fingerprint());
    }
}

/// The index of the first program instruction matching `f`.
fn find(p: &Value, f: impl Fn(&Value) -> bool) -> usize {
    p["program"].as_array().expect("a program").iter().position(f).expect("an instruction of that kind")
}

fn is_collective(kind: &str) -> impl Fn(&Value) -> bool + '_ {
    move |i: &Value| i["kind"] == "collective" && i["collective"]["kind"] == kind
}

/// An op instruction of a computing node (not an input, parameter or constant).
fn is_compute(i: &Value) -> bool {
    i["kind"] == "op" && !i["inputs"].as_array().is_none_or(|v| v.is_empty())
}

/// Every class of broken plan is refused with one line naming the instruction and the problem.
#[test]
fn edited_plans_are_refused_before_any_rank_starts() {
    let dir = tempdir();
    let good = plan(dir.path(), "auto");
    let base = read_json(&good);
    // The plan runs as made.
    run_ok(&good, &["--steps", "1"]);
    let bad = dir.path().join("bad.json");
    let case = |edit: &dyn Fn(&mut Value), phrases: &[&str]| {
        let mut p = base.clone();
        edit(&mut p);
        write_json(&bad, &p);
        run_fails(&bad, &["--steps", "1"], phrases)
    };

    let ag = find(&base, is_collective("all_gather"));
    let at = format!("instruction {ag}:");
    // Collective axes: out of range (indexing the mesh shape panicked a rank's thread), and
    // repeated (the group listed ranks twice and its rendezvous waited until the timeout).
    case(&|p| p["program"][ag]["collective"]["axes"] = json!([0, 7]), &[&at, "mesh axis 7 does not exist"]);
    case(&|p| p["program"][ag]["collective"]["axes"] = json!([1, 1]), &[&at, "mesh axis 1 appears twice"]);
    // A tensor dim out of range.
    case(&|p| p["program"][ag]["collective"]["dim"] = json!(5), &[&at, "dim 5 does not exist"]);
    // A collective that does not produce the layout it claims.
    case(&|p| p["program"][ag]["collective"]["axes"] = json!([0]), &[&at, "not the innermost axes"]);
    // Its byte count.
    case(&|p| p["program"][ag]["bytes"] = json!(1), &[&at, "1 bytes, but it moves"]);
    // A local shape that is not the spec's split of the global shape.
    let op = find(&base, is_compute);
    let op_at = format!("instruction {op}:");
    case(&|p| p["program"][op]["local_shapes"][0][0] = json!(31), &[&op_at, "local shape [31"]);
    // Layouts that are not a way to run the op: partial sums declared final (same local shapes,
    // so nothing else would notice: every rank would go on with its own partial sum).
    let partial = find(&base, |i| is_compute(i) && i["output_specs"][0].as_str().is_some_and(|s| s.contains('P')));
    let fin = base["program"][partial]["output_specs"][0].as_str().unwrap().split(" |").next().unwrap().to_string();
    case(
        &|p| p["program"][partial]["output_specs"][0] = json!(fin),
        &[&format!("instruction {partial}:"), "is not a way to run"],
    );
    // Unknown value ids: never written, malformed.
    case(&|p| p["program"][op]["inputs"][0] = json!("%99999"), &[&op_at, "%99999"]);
    case(&|p| p["program"][op]["inputs"][0] = json!("x"), &[&op_at, "not a value id"]);
    let free = find(&base, |i| i["kind"] == "free");
    case(
        &|p| p["program"][free]["values"] = json!(["%0.7"]),
        &[&format!("instruction {free}:"), "frees %0.7, which is not live"],
    );
    // Ranks: one offset list per rank of the mesh, and a mesh whose rank count overflows.
    case(&|p| p["params"][0]["offsets"].as_array_mut().unwrap().truncate(3), &["3 offsets for the 4 ranks"]);
    case(
        &|p| {
            p["mesh"]["shape"] = json!([1u64 << 32, 1u64 << 32]);
        },
        &["overflows"],
    );
    case(&|p| p["mesh"]["shape"] = json!([2, 0]), &["axis sizes must be >= 1"]);
    // A parameter's offsets that do not match its layout.
    case(&|p| p["params"][0]["offsets"][1] = json!([3, 3, 3]), &["rank 1's offsets"]);
    // Optimizer hyper-parameters: NaN and infinite learning rates (the model hash recomputed, so
    // only the range check can catch them), and a negative one.
    for (lr, why) in
        [(json!("NaN"), "lr is NaN"), (json!("inf"), "lr is inf"), (json!(-0.1), "lr is -0.1: it must be >= 0")]
    {
        case(&|p| set_lr(p, lr.clone(), true), &["sgd_update", why]);
    }
    // Without the hash recomputed, the edit itself is caught.
    case(&|p| set_lr(p, json!("NaN"), false), &["does not match the model hash"]);
    // The local op is the plan's, but it must be the node's op made local for its layouts: a
    // reshape to another shape would compute something else on every rank.
    let reshape = find(&base, |i| i["kind"] == "op" && i["op"].get("reshape").is_some());
    case(
        &|p| p["program"][reshape]["op"]["reshape"]["shape"] = json!([1]),
        &[&format!("instruction {reshape}:"), "on its blocks, but"],
    );
    // Every problem is reported at once, with its instruction.
    let line = case(
        &|p| {
            p["program"][ag]["collective"]["axes"] = json!([1, 1]);
            p["program"][op]["local_shapes"][0][0] = json!(31);
        },
        &[&at, &op_at],
    );
    assert!(line.contains("; "), "{line}");
}

/// CRC-32 (IEEE), as the checkpoint manifest records it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0xedb8_8320 } else { c >> 1 };
        }
    }
    !c
}

/// Rewrites a checkpoint's manifest so that its sizes and CRCs match the files as they are now
/// (what a careless repair or a deliberate swap would do), applying `edit` to it first.
fn fix_manifest(ck: &Path, edit: impl Fn(&mut Value)) {
    let mpath = ck.join("manifest.json");
    let mut m = read_json(&mpath);
    edit(&mut m);
    for f in m["files"].as_array_mut().expect("files") {
        // A file the edit named elsewhere keeps its entry.
        if let Ok(bytes) = std::fs::read(ck.join(f["file"].as_str().expect("a file name"))) {
            f["bytes"] = json!(bytes.len());
            f["crc32"] = json!(crc32(&bytes));
        }
    }
    write_json(&mpath, &m);
}

/// Runs two steps with a checkpoint after each into `root/ck`; returns the checkpoint
/// directory and the directories of steps 1 and 2.
fn checkpointed(plan: &Path, root: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ck = root.join("ck");
    let c = ck.display().to_string();
    run_ok(plan, &["--steps", "2", "--checkpoint", &c, "--checkpoint-every", "1"]);
    steps(&ck)
}

/// A checkpoint directory and the directories of its steps 1 and 2.
fn steps(ck: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let step = |s: &str| {
        std::fs::read_dir(ck)
            .expect("the checkpoint directory")
            .flatten()
            .map(|e| e.path())
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(s)))
            .expect("a checkpoint of that step")
    };
    (ck.to_path_buf(), step("ckpt-00000001-"), step("ckpt-00000002-"))
}

/// Copies a directory tree (regular files and directories).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("creating a directory");
    for e in std::fs::read_dir(from).expect("reading a directory").flatten() {
        if e.path().is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).expect("copying a file");
        }
    }
}

/// Shards in the wrong place are refused even when the manifest's CRCs match them: swapped
/// between ranks, from another step, from another plan, a manifest naming another step or an
/// older format.
#[test]
fn checkpoint_shards_carry_their_identity() {
    let dir = tempdir();
    let good = plan(dir.path(), "auto");
    let (made, _, _) = checkpointed(&good, &dir.path().join("made"));
    let resume = |plan: &Path, ck: &Path, phrases: &[&str]| {
        let c = ck.display().to_string();
        run_fails(plan, &["--steps", "3", "--checkpoint", &c, "--resume"], phrases)
    };
    // A copy of the checkpoint as written, per case.
    let fresh = |name: &str| {
        let ck = dir.path().join(name);
        copy_tree(&made, &ck);
        steps(&ck)
    };

    // Swapped between ranks 0 and 1.
    let (ck, _, two) = fresh("swap");
    let (r0, r1, tmp) = (two.join("rank-00000.npz"), two.join("rank-00001.npz"), two.join("t"));
    std::fs::rename(&r0, &tmp).unwrap();
    std::fs::rename(&r1, &r0).unwrap();
    std::fs::rename(&tmp, &r1).unwrap();
    fix_manifest(&two, |_| {});
    resume(&good, &ck, &["rank-00000.npz", "holds the blocks of rank 1, not of rank 0", "swapped"]);

    // A shard of step 1 in the checkpoint of step 2.
    let (ck, one, two) = fresh("step");
    std::fs::copy(one.join("rank-00002.npz"), two.join("rank-00002.npz")).unwrap();
    fix_manifest(&two, |_| {});
    resume(&good, &ck, &["rank-00002.npz", "is a shard of step 1, but the checkpoint is of step 2"]);

    // The manifest's step changed.
    let (ck, _, two) = fresh("manifest-step");
    fix_manifest(&two, |m| m["step"] = json!(5));
    resume(&good, &ck, &["rank-00000.npz", "is a shard of step 2, but the checkpoint is of step 5"]);

    // A manifest naming a file elsewhere.
    let (ck, _, two) = fresh("file");
    fix_manifest(&two, |m| m["files"][0]["file"] = json!("../rank-00000.npz"));
    resume(&good, &ck, &["names `../rank-00000.npz` as the file of rank 0"]);

    // The format before shard headers.
    let (ck, _, two) = fresh("old");
    fix_manifest(&two, |m| m["version"] = json!(1));
    resume(&good, &ck, &["checkpoint format too old"]);

    // Another plan of the same model and mesh (other layouts): the checkpoint as a whole, and
    // one of its shards slipped into this plan's checkpoint with the manifest repaired (its
    // header says so, whatever its blocks' shapes).
    let dp = plan(dir.path(), "dp");
    let (ck, _, _) = fresh("other-plan");
    resume(&dp, &ck, &["written for another plan"]);
    let (_, _, dp_two) = checkpointed(&dp, &dir.path().join("dp"));
    let (ck, _, two) = fresh("other-shard");
    std::fs::copy(dp_two.join("rank-00003.npz"), two.join("rank-00003.npz")).unwrap();
    fix_manifest(&two, |_| {});
    resume(&good, &ck, &["rank-00003.npz", "written for another plan"]);

    // The checkpoint as written resumes.
    let (ck, _, _) = fresh("good");
    let c = ck.display().to_string();
    let out = run_ok(&good, &["--steps", "3", "--checkpoint", &c, "--resume"]);
    assert!(out.contains("resumed from"), "{out}");
}

/// `LATEST` must name a directory directly inside the checkpoint directory.
#[test]
fn latest_stays_inside_the_checkpoint_directory() {
    let dir = tempdir();
    let good = plan(dir.path(), "auto");
    let (ck, _, two) = checkpointed(&good, &dir.path().join("run"));
    let c = ck.display().to_string();
    let latest = ck.join("LATEST");
    let resume = |phrases: &[&str]| run_fails(&good, &["--steps", "3", "--checkpoint", &c, "--resume"], phrases);
    // A complete, valid checkpoint outside the directory: followed before.
    let outside = dir.path().join("elsewhere");
    copy_tree(&two, &outside.join("ckpt"));
    let abs = outside.join("ckpt").display().to_string();
    for name in [abs.as_str(), "/tmp", "../x", "../elsewhere/ckpt", "a/../../x", "./"] {
        std::fs::write(&latest, format!("{name}\n")).unwrap();
        resume(&["LATEST", "not a checkpoint directory inside"]);
    }
    // A symbolic link inside the directory that leads out of it.
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(outside.join("ckpt"), ck.join("escape")).unwrap();
        std::fs::write(&latest, "escape\n").unwrap();
        resume(&["LATEST", "leads outside"]);
    }
    // Not a regular file.
    std::fs::remove_file(&latest).unwrap();
    std::fs::create_dir(&latest).unwrap();
    resume(&["LATEST", "not a regular file"]);
}
