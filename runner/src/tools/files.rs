//! The file tools: `read_file`, `write_file`, `edit_file`, `list_files`. Each runs on the
//! blocking pool (plain `std::fs`), confined to the workspace: every path is opened beneath it by
//! [`Workspace::open_beneath`].

use std::fs;
use std::io::{Read, Write};
use std::path::Path;

use nix::dir::{Dir, Type};
use nix::fcntl::OFlag;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{parse, ToolOutput, Workspace, OUTPUT_CAP};

/// The most entries `list_files` shows.
const LIST_CAP: usize = 2000;

/// Parses the input of tool `name` and runs `tool` off the async runtime.
pub(super) async fn run_blocking<T, F>(
    workspace: Workspace,
    name: &str,
    input: Map<String, Value>,
    tool: F,
) -> ToolOutput
where
    T: DeserializeOwned + Send + 'static,
    F: FnOnce(&Workspace, T) -> Result<String, String> + Send + 'static,
{
    let input: T = match parse(name, input) {
        Ok(input) => input,
        Err(error) => return error,
    };
    match tokio::task::spawn_blocking(move || tool(&workspace, input)).await {
        Ok(Ok(content)) => ToolOutput::ok(content),
        Ok(Err(message)) => ToolOutput::error(message),
        Err(e) => ToolOutput::error(format!("{name} failed: {e}")),
    }
}

#[derive(Deserialize)]
pub(super) struct ReadFile {
    path: String,
}

#[derive(Deserialize)]
pub(super) struct WriteFile {
    path: String,
    content: String,
}

#[derive(Deserialize)]
pub(super) struct EditFile {
    path: String,
    old: String,
    new: String,
}

#[derive(Deserialize)]
pub(super) struct ListFiles {
    #[serde(default)]
    path: Option<String>,
}

pub(super) fn read_file(ws: &Workspace, input: ReadFile) -> Result<String, String> {
    let relative = ws.relative(&input.path)?;
    let file = open_regular(ws, &relative, OFlag::O_RDONLY, &input.path)?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read `{}`: {e}", input.path))?;
    let size = meta.len();
    // Read one byte past the cap to know whether there was more, without loading a huge
    // file into memory.
    let mut bytes = Vec::new();
    file.take(OUTPUT_CAP as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read `{}`: {e}", input.path))?;
    if bytes.len() > OUTPUT_CAP {
        bytes.truncate(OUTPUT_CAP);
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        text.push_str(&format!(
            "\n[file cut: showing the first {OUTPUT_CAP} of {size} bytes]"
        ));
        return Ok(text);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Opens `relative` beneath the workspace and makes sure it is a regular file. Opened
/// non-blocking, so a FIFO planted by a bash call cannot hang the tool.
fn open_regular(
    ws: &Workspace,
    relative: &Path,
    flags: OFlag,
    shown: &str,
) -> Result<fs::File, String> {
    let file = fs::File::from(ws.open_beneath(relative, flags | OFlag::O_NONBLOCK, shown)?);
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot open `{shown}`: {e}"))?;
    if meta.is_dir() {
        return Err(format!("`{shown}` is a directory; use list_files"));
    }
    if !meta.is_file() {
        return Err(format!("`{shown}` is not a regular file"));
    }
    Ok(file)
}

/// Replaces the content of `relative` (creating it), opened beneath the workspace.
fn write_beneath(
    ws: &Workspace,
    relative: &Path,
    content: &str,
    shown: &str,
) -> Result<(), String> {
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC;
    let mut file = open_regular(ws, relative, flags, shown)?;
    file.write_all(content.as_bytes())
        .map_err(|e| format!("cannot write `{shown}`: {e}"))
}

pub(super) fn write_file(ws: &Workspace, input: WriteFile) -> Result<String, String> {
    let relative = ws.relative(&input.path)?;
    if relative.as_os_str().is_empty() {
        return Err(format!(
            "`{}` is the workspace itself; name a file",
            input.path
        ));
    }
    if let Some(parent) = relative.parent() {
        ws.create_dirs(parent, &input.path)?;
    }
    write_beneath(ws, &relative, &input.content, &input.path)?;
    Ok(format!(
        "wrote {} bytes to {}",
        input.content.len(),
        input.path
    ))
}

pub(super) fn edit_file(ws: &Workspace, input: EditFile) -> Result<String, String> {
    if input.old.is_empty() {
        return Err("`old` is empty; give text that occurs exactly once in the file".into());
    }
    let relative = ws.relative(&input.path)?;
    let mut text = String::new();
    open_regular(ws, &relative, OFlag::O_RDONLY, &input.path)?
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read `{}`: {e}", input.path))?;
    match text.matches(&input.old).count() {
        1 => {}
        0 => return Err(format!("`old` does not occur in `{}`", input.path)),
        n => {
            return Err(format!(
                "`old` occurs {n} times in `{}`; include more context so it occurs exactly once",
                input.path
            ))
        }
    }
    let edited = text.replacen(&input.old, &input.new, 1);
    write_beneath(ws, &relative, &edited, &input.path)?;
    Ok(format!("edited {}", input.path))
}

pub(super) fn list_files(ws: &Workspace, input: ListFiles) -> Result<String, String> {
    let shown = input.path.unwrap_or_default();
    let relative = ws.relative(&shown)?;
    let mut entries = Vec::new();
    let mut more = false;
    walk(
        ws,
        &relative,
        Path::new(""),
        &shown,
        &mut entries,
        &mut more,
    )?;
    if entries.is_empty() {
        return Ok("(empty directory)".into());
    }
    let mut listing = entries.join("\n");
    if more {
        listing.push_str(&format!("\n[listing cut after {LIST_CAP} entries]"));
    }
    Ok(listing)
}

/// Depth-first, sorted, not following symbolic links (a link is shown with a trailing `@`).
/// Each directory is opened beneath the workspace.
fn walk(
    ws: &Workspace,
    base: &Path,
    below: &Path,
    shown: &str,
    out: &mut Vec<String>,
    more: &mut bool,
) -> Result<(), String> {
    // Below the listed directory, a symbolic link is never followed (it is shown as one).
    let mut flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
    if !below.as_os_str().is_empty() {
        flags |= OFlag::O_NOFOLLOW;
    }
    let dir = ws.open_beneath(&base.join(below), flags, shown);
    let dir = match dir {
        Ok(dir) => dir,
        Err(e) if below.as_os_str().is_empty() && e.contains("a part of the path") => {
            return Err(format!("`{shown}` is not a directory"))
        }
        Err(e) => return Err(e),
    };
    let mut children: Vec<(String, Option<Type>)> = Dir::from_fd(dir)
        .map_err(|e| format!("cannot list `{shown}`: {e}"))?
        .into_iter()
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            (name != "." && name != "..").then(|| (name, entry.file_type()))
        })
        .collect();
    children.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, kind) in children {
        if out.len() >= LIST_CAP {
            *more = true;
            return Ok(());
        }
        let path = below.join(&name);
        let display = path.display().to_string();
        match kind {
            Some(Type::Symlink) => out.push(format!("{display}@")),
            Some(Type::Directory) => {
                out.push(format!("{display}/"));
                walk(ws, base, &path, shown, out, more)?;
            }
            _ => out.push(display),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use crate::tools::{Sandbox, Toolbox};

    use super::*;

    fn input(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    async fn run(toolbox: &Toolbox, name: &str, value: Value) -> ToolOutput {
        toolbox
            .run(
                "s1",
                name,
                input(value),
                "s1/t",
                &tokio_util::sync::CancellationToken::new(),
            )
            .await
            .expect("not stopped")
    }

    fn setup() -> (tempfile::TempDir, Toolbox, PathBuf) {
        let root = tempfile::tempdir().expect("temp dir");
        let toolbox = Toolbox::new(root.path().to_path_buf(), Sandbox::unconfined_for_tests());
        let ws = root.path().join("s1");
        (root, toolbox, ws)
    }

    #[tokio::test]
    async fn write_read_edit_and_list() {
        let (_root, tb, ws) = setup();
        let out = run(
            &tb,
            "write_file",
            json!({"path": "src/a.txt", "content": "one two two"}),
        )
        .await;
        assert!(!out.is_error, "{out:?}");
        assert_eq!(
            fs::read_to_string(ws.join("src/a.txt")).ok().as_deref(),
            Some("one two two")
        );

        let out = run(&tb, "read_file", json!({"path": "src/a.txt"})).await;
        assert_eq!(
            out,
            ToolOutput {
                content: "one two two".into(),
                is_error: false
            }
        );

        let out = run(
            &tb,
            "edit_file",
            json!({"path": "src/a.txt", "old": "two", "new": "2"}),
        )
        .await;
        assert!(
            out.is_error && out.content.contains("occurs 2 times"),
            "{out:?}"
        );
        let out = run(
            &tb,
            "edit_file",
            json!({"path": "src/a.txt", "old": "three", "new": "3"}),
        )
        .await;
        assert!(
            out.is_error && out.content.contains("does not occur"),
            "{out:?}"
        );
        let out = run(
            &tb,
            "edit_file",
            json!({"path": "src/a.txt", "old": "one", "new": "1"}),
        )
        .await;
        assert!(!out.is_error, "{out:?}");
        assert_eq!(
            fs::read_to_string(ws.join("src/a.txt")).ok().as_deref(),
            Some("1 two two")
        );

        let out = run(&tb, "list_files", json!({})).await;
        assert_eq!(out.content, ".tmp/\nsrc/\nsrc/a.txt");
        let out = run(&tb, "list_files", json!({"path": "src"})).await;
        assert_eq!(out.content, "a.txt");
    }

    #[tokio::test]
    async fn file_tools_refuse_to_leave_the_workspace() {
        let (root, tb, ws) = setup();
        fs::write(root.path().join("secret"), "s3cr3t").expect("write");
        fs::create_dir_all(&ws).expect("mkdir");
        std::os::unix::fs::symlink(root.path(), ws.join("up")).expect("symlink");
        for (name, value) in [
            ("read_file", json!({"path": "../secret"})),
            ("read_file", json!({"path": root.path().join("secret")})),
            ("read_file", json!({"path": "up/secret"})),
            ("write_file", json!({"path": "up/evil", "content": "x"})),
            (
                "edit_file",
                json!({"path": "up/secret", "old": "s", "new": "t"}),
            ),
            ("list_files", json!({"path": "up"})),
        ] {
            let out = run(&tb, name, value.clone()).await;
            assert!(out.is_error, "{name} {value} → {out:?}");
        }
        assert_eq!(
            fs::read_to_string(root.path().join("secret"))
                .ok()
                .as_deref(),
            Some("s3cr3t")
        );
        assert!(!root.path().join("evil").exists());
    }

    #[tokio::test]
    async fn a_fifo_is_refused_without_blocking() {
        let (_root, tb, ws) = setup();
        fs::create_dir_all(&ws).expect("mkdir");
        nix::unistd::mkfifo(
            &ws.join("pipe"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .expect("mkfifo");
        for (name, value) in [
            ("read_file", json!({"path": "pipe"})),
            ("edit_file", json!({"path": "pipe", "old": "a", "new": "b"})),
            ("write_file", json!({"path": "pipe", "content": "x"})),
        ] {
            let out = run(&tb, name, value).await;
            assert!(out.is_error, "{name}: {out:?}");
        }
    }

    #[tokio::test]
    async fn big_files_are_cut_and_missing_files_are_errors() {
        let (_root, tb, ws) = setup();
        fs::create_dir_all(&ws).expect("mkdir");
        fs::write(ws.join("big"), vec![b'x'; OUTPUT_CAP * 2]).expect("write");
        let out = run(&tb, "read_file", json!({"path": "big"})).await;
        assert!(!out.is_error);
        assert!(out
            .content
            .ends_with(&format!("of {} bytes]", OUTPUT_CAP * 2)));
        let out = run(&tb, "read_file", json!({"path": "nope"})).await;
        assert!(out.is_error && out.content.contains("`nope`: no such file"));
        let out = run(&tb, "read_file", json!({"path": "."})).await;
        assert!(out.is_error && out.content.contains("is a directory"));
    }
}
