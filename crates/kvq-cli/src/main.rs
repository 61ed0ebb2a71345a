//! `kvq`: the command line. Parses, runs, prints errors readably and exits with the error's code
//! (2: fix the command or its inputs; 3: needs a GPU; 1: anything else).

use std::process::ExitCode;

use clap::Parser;
use kvq_cli::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match kvq_cli::run::run(cli, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", e.report());
            ExitCode::from(e.exit_code())
        }
    }
}
