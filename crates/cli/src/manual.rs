//! `outboard completions SHELL` and `outboard man`: shell completions and manual pages made
//! from the command line's own definition, so they cannot fall behind it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

/// `outboard completions`.
#[derive(Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    shell: clap_complete::Shell,
}

/// `outboard man`.
#[derive(Args)]
pub struct ManArgs {
    /// Write outboard.1 and a page per command (outboard-blk.1, …) into this directory
    /// instead of printing outboard.1 (e.g. /usr/local/share/man/man1).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// Prints the completion script for `a.shell` of `cmd` to standard output.
pub fn completions(a: CompletionsArgs, mut cmd: clap::Command) -> Result<ExitCode, String> {
    let name = cmd.get_name().to_string();
    clap_complete::generate(a.shell, &mut cmd, name, &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

/// Prints `cmd`'s manual page, or writes it and one per visible subcommand into `a.dir`.
pub fn man(a: ManArgs, cmd: clap::Command) -> Result<ExitCode, String> {
    let Some(dir) = a.dir else {
        let mut out = std::io::stdout().lock();
        clap_mangen::Man::new(cmd)
            .render(&mut out)
            .map_err(|e| format!("standard output: {e}"))?;
        return Ok(ExitCode::SUCCESS);
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let written = write_pages(&dir, cmd.clone(), cmd.get_name())?;
    outboard_sys::errln!("wrote {written} manual pages in {}", dir.display());
    Ok(ExitCode::SUCCESS)
}

/// Writes `cmd`'s page as `NAME.1` in `dir`, then its visible subcommands' as
/// `NAME-SUB.1`; returns how many.
fn write_pages(dir: &Path, cmd: clap::Command, name: &str) -> Result<usize, String> {
    let path = dir.join(format!("{name}.1"));
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone().name(name.to_string()))
        .render(&mut page)
        .map_err(|e| e.to_string())?;
    std::fs::write(&path, page).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut written = 1;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        let sub_name = format!("{name}-{}", sub.get_name());
        written += write_pages(dir, sub.clone(), &sub_name)?;
    }
    Ok(written)
}
