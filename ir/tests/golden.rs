//! Golden text tests (in the style of cranelift's filetests).
//!
//! Each `tests/golden/*.ir` file holds a header line `; pass: NAME` (`roundtrip`,
//! `canonicalize`, or `train LOSS OPTIMIZER` with OPTIMIZER `none`, `sgd:LR[:MOMENTUM]` or
//! `adamw:LR`: the training graph of [`ir::autodiff::training_graph`]), an input graph, a line `; expect:` and the expected printed graph after the
//! pass. The input must verify, the output must verify, and the printer/parser must round-trip.
//! Run with `BLESS=1` to rewrite the expectations from the current output.

use std::path::Path;

fn run_case(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let pass = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("; pass:"))
        .map(str::trim)
        .ok_or("first line must be `; pass: NAME`")?
        .to_string();
    let (input, expected) = text.split_once("; expect:\n").ok_or("missing `; expect:` line")?;
    let input_body: String = input.lines().skip(1).map(|l| format!("{l}\n")).collect();
    let mut g = ir::Graph::parse(&input_body).map_err(|e| format!("parse: {e}"))?;
    ir::verify(&g).map_err(|e| format!("input does not verify: {e}"))?;
    match pass.as_str() {
        "roundtrip" => {}
        "canonicalize" => {
            ir::passes::canonicalize(&mut g).map_err(|e| e.to_string())?;
        }
        p if p.starts_with("train ") => {
            let words: Vec<&str> = p.split_whitespace().collect();
            let [_, loss, opt] = words[..] else { return Err(format!("expected `train LOSS OPTIMIZER`, got {p}")) };
            let loss = loss.parse()?;
            let num = |s: &str| s.parse::<f32>().map_err(|e| format!("{s}: {e}"));
            let parts: Vec<&str> = opt.split(':').collect();
            let optimizer = match parts[..] {
                ["none"] => None,
                ["sgd", lr] => Some(ir::autodiff::Optimizer::sgd(num(lr)?)),
                ["sgd", lr, m] => {
                    Some(ir::autodiff::Optimizer::Sgd { lr: num(lr)?, momentum: num(m)?, weight_decay: 0.0 })
                }
                ["adamw", lr] => Some(ir::autodiff::Optimizer::adamw(num(lr)?)),
                _ => return Err(format!("unknown optimizer {opt}")),
            };
            let opts = ir::autodiff::TrainOptions::new(loss, optimizer);
            g = ir::autodiff::training_graph(&g, &opts).map_err(|e| e.to_string())?.graph;
        }
        p => return Err(format!("unknown pass {p}")),
    }
    ir::verify(&g).map_err(|e| format!("output does not verify: {e}"))?;
    let got = g.to_text();
    let again = ir::Graph::parse(&got).map_err(|e| format!("reparse: {e}"))?.to_text();
    if again != got {
        return Err(format!("printer/parser do not round-trip:\n{got}\nvs\n{again}"));
    }
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(path, format!("{input}; expect:\n{got}")).map_err(|e| e.to_string())?;
        return Ok(());
    }
    if got != expected {
        return Err(format!("output differs (BLESS=1 to accept)\n--- expected\n{expected}--- got\n{got}"));
    }
    Ok(())
}

#[test]
fn golden() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("golden dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "ir"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    let mut failed = Vec::new();
    for f in &files {
        if let Err(e) = run_case(f) {
            failed.push(format!("{}: {e}", f.display()));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
