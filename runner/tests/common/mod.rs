//! Shared by the runner's integration tests: a toolbox whose tools run through the real
//! sandbox helper (this package's `runner` binary), as the runner's defaults have them.

use std::path::Path;

use runner::tools::sandbox::{Ids, Sandbox, SandboxMode, ToolNetwork};
use runner::tools::Toolbox;

/// A toolbox over `root` under the required sandbox, started (probed) as the runner starts
/// it; as root, tools run as nobody.
pub async fn toolbox(root: &Path) -> Toolbox {
    let root_user = nix::unistd::geteuid().is_root();
    let sandbox = Sandbox {
        mode: SandboxMode::Require,
        network: ToolNetwork::None,
        // As root, tools run as nobody, as the runner's default has them.
        user: root_user.then_some(Ids {
            uid: 65534,
            gid: 65534,
        }),
        read_paths: Vec::new(),
        helper: env!("CARGO_BIN_EXE_runner").into(),
        secret_files: Vec::new(),
        table: None,
    };
    sandbox.open_path_to(root).expect("reachable root");
    let mut sandbox = sandbox;
    sandbox
        .start(root, false)
        .await
        .expect("this kernel enforces the sandbox");
    Toolbox::new(root.to_path_buf(), sandbox)
}
