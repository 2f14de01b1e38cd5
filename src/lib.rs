//! The `autopar` command line's work as a library: the subcommands ([`cmd`]) and the one-line
//! error messages the CLI prints. The binary (`src/main.rs`) parses the command line and calls
//! these; the Python package (`python/`) calls the same functions, so both faces share one code
//! path and one error text.

pub mod cmd;

use clap::Parser;

/// A command-line error as the CLI prints it after `error: `, on one line. A value our parsers
/// refused reads like every other flag error (`--memory lots: not a size like 16GiB, ...`;
/// clap's own form is `invalid value 'lots' for '--memory <SIZE>'`); otherwise clap's message
/// and its tips, without the usage block that follows.
pub fn usage_message(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let context = |k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    match (e.kind(), context(ContextKind::InvalidArg), context(ContextKind::InvalidValue)) {
        (ErrorKind::ValueValidation, Some(arg), Some(value)) if std::error::Error::source(e).is_some() => {
            let flag = arg.split_whitespace().next().unwrap_or(&arg).to_string();
            let why = std::error::Error::source(e).map(|c| c.to_string()).unwrap_or_default();
            format!("{flag} {value}: {why}")
        }
        _ => {
            let text = e.render().to_string();
            let lines: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let msg = lines.join(" ");
            msg.strip_prefix("error: ").unwrap_or(&msg).to_string()
        }
    }
}

/// A failure as the CLI prints it after `error: `: the error and its causes, on one line.
pub fn error_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace('\n', " ")
}

/// `autopar autoparallelize`'s arguments alone, for [`parse_plan_args`].
#[derive(Parser, Debug)]
#[command(name = "autopar autoparallelize", no_binary_name = true)]
struct PlanCommand {
    #[command(flatten)]
    args: cmd::plan::PlanArgs,
}

/// Parses `autopar autoparallelize`'s arguments (without the program and subcommand names, e.g.
/// `["model.onnx", "--mesh", "2x2", "--memory", "16GiB"]`) as the CLI does; an error is the
/// CLI's message ([`usage_message`]).
pub fn parse_plan_args<I, S>(args: I) -> Result<cmd::plan::PlanArgs, String>
where
    I: IntoIterator<Item = S>,
    S: Into<std::ffi::OsString> + Clone,
{
    PlanCommand::try_parse_from(args).map(|c| c.args).map_err(|e| usage_message(&e))
}

/// `autopar run`'s arguments alone, for [`parse_run_args`].
#[derive(Parser, Debug)]
#[command(name = "autopar run", no_binary_name = true)]
struct RunCommand {
    #[command(flatten)]
    args: cmd::run::RunArgs,
}

/// Parses `autopar run`'s arguments (without the program and subcommand names) as the CLI does;
/// an error is the CLI's message ([`usage_message`]).
pub fn parse_run_args<I, S>(args: I) -> Result<cmd::run::RunArgs, String>
where
    I: IntoIterator<Item = S>,
    S: Into<std::ffi::OsString> + Clone,
{
    RunCommand::try_parse_from(args).map(|c| c.args).map_err(|e| usage_message(&e))
}
