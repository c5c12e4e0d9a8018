//! The file tools: `read_file`, `write_file`, `edit_file`, `list_files`. Each runs on the
//! blocking pool (plain `std::fs`), confined to the workspace by [`Workspace::resolve`].

use std::fs;
use std::io::Read;
use std::path::Path;

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
    let path = ws.resolve(&input.path)?;
    let file = fs::File::open(&path).map_err(|e| format!("cannot read `{}`: {e}", input.path))?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if path.is_dir() {
        return Err(format!("`{}` is a directory; use list_files", input.path));
    }
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

pub(super) fn write_file(ws: &Workspace, input: WriteFile) -> Result<String, String> {
    let path = ws.resolve(&input.path)?;
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create the directory of `{}`: {e}", input.path))?;
    }
    fs::write(&path, input.content.as_bytes())
        .map_err(|e| format!("cannot write `{}`: {e}", input.path))?;
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
    let path = ws.resolve(&input.path)?;
    let text =
        fs::read_to_string(&path).map_err(|e| format!("cannot read `{}`: {e}", input.path))?;
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
    fs::write(&path, edited.as_bytes())
        .map_err(|e| format!("cannot write `{}`: {e}", input.path))?;
    Ok(format!("edited {}", input.path))
}

pub(super) fn list_files(ws: &Workspace, input: ListFiles) -> Result<String, String> {
    let shown = input.path.unwrap_or_default();
    let dir = ws.resolve(&shown)?;
    if !dir.is_dir() {
        return Err(format!("`{shown}` is not a directory"));
    }
    let mut entries = Vec::new();
    let mut more = false;
    walk(&dir, &dir, &mut entries, &mut more).map_err(|e| format!("cannot list `{shown}`: {e}"))?;
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
fn walk(base: &Path, dir: &Path, out: &mut Vec<String>, more: &mut bool) -> std::io::Result<()> {
    let mut children: Vec<_> = fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    children.sort_by_key(|entry| entry.file_name());
    for entry in children {
        if out.len() >= LIST_CAP {
            *more = true;
            return Ok(());
        }
        let path = entry.path();
        let shown = path
            .strip_prefix(base)
            .unwrap_or(&path)
            .display()
            .to_string();
        let kind = entry.file_type()?;
        if kind.is_symlink() {
            out.push(format!("{shown}@"));
        } else if kind.is_dir() {
            out.push(format!("{shown}/"));
            walk(base, &path, out, more)?;
        } else {
            out.push(shown);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use crate::tools::Toolbox;

    use super::*;

    fn input(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    async fn run(toolbox: &Toolbox, name: &str, value: Value) -> ToolOutput {
        toolbox.run("s1", name, input(value), "s1/t").await
    }

    fn setup() -> (tempfile::TempDir, Toolbox, PathBuf) {
        let root = tempfile::tempdir().expect("temp dir");
        let toolbox = Toolbox::new(root.path().to_path_buf());
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
        assert_eq!(out.content, "src/\nsrc/a.txt");
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
        assert!(out.is_error && out.content.contains("cannot read `nope`"));
        let out = run(&tb, "read_file", json!({"path": "."})).await;
        assert!(out.is_error && out.content.contains("is a directory"));
    }
}
