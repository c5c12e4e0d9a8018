//! Containers, for the tests that run the images users deploy: a compose project (a compose
//! file started under a name of its own, and removed with its containers, networks and
//! volumes when dropped), the engine's commands for faults (stop with a grace period, kill,
//! cutting a container off its network), and the images the tests need beside the product's
//! (a PostgreSQL, the model stand-in and an S3-compatible server), made on the same Debian
//! bases with no registry.
//!
//! The product images are `agentlog/{event-store,runner,web}:TAG`, built by `deploy/images`
//! (TAG from `AGENTLOG_IMAGE_TAG`, else `local`), and the last release's are tagged with its
//! version, built by `deploy/previous-release --images`; a test that finds them missing says
//! so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

/// The repository's root (this crate's parent directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit sits in the repository")
        .to_path_buf()
}

/// The tag of the product images under test.
pub fn image_tag() -> String {
    std::env::var("AGENTLOG_IMAGE_TAG").unwrap_or_else(|_| "local".into())
}

/// Runs `docker ARGS`; its stdout, trimmed, or an error carrying its stderr.
pub fn docker(args: &[&str]) -> Result<String> {
    run(
        Command::new("docker").args(args),
        &format!("docker {}", args.join(" ")),
    )
}

fn run(command: &mut Command, what: &str) -> Result<String> {
    let out = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{what}: cannot run it"))?;
    ensure!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Fails, saying what to do, unless the engine answers and the product images are built.
pub fn require_product_images() -> Result<String> {
    let tag = image_tag();
    require_images(&tag, &format!("deploy/images --tag {tag}"))?;
    Ok(tag)
}

/// The tag of the last release's images (its version), built by `deploy/previous-release
/// --images`; fails, saying so, unless they are there.
pub fn require_previous_release_images() -> Result<String> {
    let how = "eval \"$(deploy/previous-release --images)\"";
    let tag = std::env::var(crate::previous::VERSION_ENV).with_context(|| {
        format!(
            "{} is not set: build the last release's images first with `{how}`",
            crate::previous::VERSION_ENV
        )
    })?;
    require_images(&tag, how)?;
    Ok(tag)
}

fn require_images(tag: &str, how: &str) -> Result<()> {
    docker(&["info", "--format", "{{.ServerVersion}}"])
        .context("no container engine answers: these tests need the Docker daemon")?;
    for image in ["event-store", "runner", "web"] {
        let name = format!("agentlog/{image}:{tag}");
        if docker(&["image", "inspect", "--format", "{{.Id}}", &name]).is_err() {
            bail!("{name} is missing: build the images first with `{how}`");
        }
    }
    Ok(())
}

/// `docker compose` (Compose v2) where the engine's CLI has it, else `docker-compose` (v1).
fn compose_program() -> Vec<String> {
    let v2 = Command::new("docker")
        .args(["compose", "version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if v2 {
        vec!["docker".into(), "compose".into()]
    } else {
        vec!["docker-compose".into()]
    }
}

/// A running compose project; `down -v` when dropped.
pub struct Project {
    pub name: String,
    file: PathBuf,
    env: Vec<(String, String)>,
    program: Vec<String>,
}

impl Project {
    /// Starts every service of `file` (`up -d`) with `env` for its `${…}`s, under a project
    /// name made from `prefix`, the process id and a counter.
    pub fn up(prefix: &str, file: &Path, env: &[(&str, String)]) -> Result<Project> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let project = Project {
            name: format!(
                "{prefix}{}x{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            file: file.to_path_buf(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            program: compose_program(),
        };
        project.compose(&["up", "-d", "--no-build"])?;
        Ok(project)
    }

    /// Runs a compose command of this project, with its environment and `extra_env`.
    pub fn compose_with(&self, args: &[&str], extra_env: &[(&str, String)]) -> Result<String> {
        let mut command = Command::new(&self.program[0]);
        command
            .args(&self.program[1..])
            .arg("-p")
            .arg(&self.name)
            .arg("-f")
            .arg(&self.file)
            .args(args);
        for (k, v) in &self.env {
            command.env(k, v);
        }
        for (k, v) in extra_env {
            command.env(k, v);
        }
        run(
            &mut command,
            &format!("{} {}", self.program.join(" "), args.join(" ")),
        )
    }

    pub fn compose(&self, args: &[&str]) -> Result<String> {
        self.compose_with(args, &[])
    }

    /// The id of `service`'s container (the running or last one).
    pub fn container(&self, service: &str) -> Result<String> {
        let id = self.compose(&["ps", "-q", service])?;
        let id = id.lines().next().unwrap_or("").trim().to_string();
        ensure!(!id.is_empty(), "{}: no container for {service}", self.name);
        Ok(id)
    }

    /// The project's network, which compose names after the project.
    pub fn network(&self) -> String {
        format!("{}_default", self.name)
    }

    /// What `service`'s container wrote to stdout and stderr so far.
    pub fn logs(&self, service: &str) -> String {
        let Ok(id) = self.container(service) else {
            return String::new();
        };
        Command::new("docker")
            .args(["logs", &id])
            .output()
            .map(|out| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                )
            })
            .unwrap_or_default()
    }

    /// Waits until `service`'s logs hold `needle`; its logs so far if they never do.
    pub fn wait_for_log(&self, service: &str, needle: &str, bound: Duration) -> Result<String> {
        let deadline = Instant::now() + bound;
        loop {
            let logs = self.logs(service);
            if logs.contains(needle) {
                return Ok(logs);
            }
            if Instant::now() > deadline {
                bail!("{service} never logged {needle:?} within {bound:?}; its logs:\n{logs}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `docker stop -t SECS`: SIGTERM, then SIGKILL after the grace period, as Kubernetes
    /// stops a pod.
    pub fn stop(&self, service: &str, grace_secs: u32) -> Result<()> {
        let id = self.container(service)?;
        docker(&["stop", "-t", &grace_secs.to_string(), &id]).map(drop)
    }

    /// `docker kill`: SIGKILL, nothing drains.
    pub fn kill(&self, service: &str) -> Result<()> {
        let id = self.container(service)?;
        docker(&["kill", &id]).map(drop)
    }

    /// `docker start` of the service's stopped container (the same one, on its volumes).
    pub fn start(&self, service: &str) -> Result<()> {
        let id = self.container(service)?;
        docker(&["start", &id]).map(drop)
    }

    /// Replaces `service`'s container by one made from the file again with `extra_env`
    /// (a new image tag, say), as a new pod replaces an old one: `up -d --no-deps
    /// --renew-anon-volumes`, which recreates what changed, its anonymous volumes (a pod's
    /// `emptyDir`s) new and empty.
    pub fn replace(&self, service: &str, extra_env: &[(&str, String)]) -> Result<()> {
        self.compose_with(
            &["up", "-d", "--no-deps", "--renew-anon-volumes", service],
            extra_env,
        )
        .map(drop)
    }

    /// Cuts `service` off the project's network: its packets go nowhere until
    /// [`Project::reconnect`].
    pub fn disconnect(&self, service: &str) -> Result<()> {
        let id = self.container(service)?;
        docker(&["network", "disconnect", &self.network(), &id]).map(drop)
    }

    /// Joins `service` to the project's network again, under its service name.
    pub fn reconnect(&self, service: &str) -> Result<()> {
        let id = self.container(service)?;
        docker(&[
            "network",
            "connect",
            "--alias",
            service,
            &self.network(),
            &id,
        ])
        .map(drop)
    }

    /// Runs `command` in `service`'s running container.
    pub fn exec(&self, service: &str, command: &[&str]) -> Result<String> {
        let id = self.container(service)?;
        let mut args = vec!["exec", id.as_str()];
        args.extend_from_slice(command);
        docker(&args)
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if std::env::var_os("AGENTLOG_KEEP_CONTAINERS").is_some() {
            eprintln!(
                "AGENTLOG_KEEP_CONTAINERS: compose project {} left running",
                self.name
            );
            return;
        }
        if let Err(e) = self.compose(&["down", "-v", "--remove-orphans", "--timeout", "1"]) {
            eprintln!("compose down of {}: {e:#}", self.name);
        }
    }
}

/// A named volume that is removed when dropped.
pub struct Volume(pub String);

impl Volume {
    pub fn create(prefix: &str) -> Result<Volume> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{prefix}{}x{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        docker(&["volume", "create", &name])?;
        Ok(Volume(name))
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        let _ = docker(&["volume", "rm", "-f", &self.0]);
    }
}

/// The images the container tests need beside the product's, on the same bases:
/// `agentlog-test/postgres:test` (Debian's PostgreSQL 15, started as a primary or a
/// streaming standby), `agentlog-test/model-standin:test` (the `model-standin` binary of
/// this build) and `agentlog-test/s3:test` (moto's S3-compatible server, from PyPI's wheels).
/// They stay cached like the bases; a rebuild replaces them (the layers that did not change
/// are reused) and removes the image it replaced.
pub struct HelperImages {
    pub postgres: String,
    pub model_standin: String,
    pub s3: String,
}

/// moto's wheels and its dependencies', for the `s3` image: downloaded from PyPI once into
/// `target/s3-wheels` (again when the pinned release changes), so that the image's build
/// asks no index and its layers stay cached. Called under [`helper_images`]'s lock.
fn s3_wheels() -> Result<PathBuf> {
    let dir = repo_root().join("target/s3-wheels");
    let stamp = dir.join(".release");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(crate::s3::MOTO_SERVER) {
        return Ok(dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).context("mkdir target/s3-wheels")?;
    run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--quiet"])
            .args([
                "--disable-pip-version-check",
                "--only-binary=:all:",
                "--dest",
            ])
            .arg(&dir)
            .arg(crate::s3::MOTO_SERVER),
        &format!("pip download {}", crate::s3::MOTO_SERVER),
    )?;
    std::fs::write(&stamp, crate::s3::MOTO_SERVER)?;
    Ok(dir)
}

pub fn helper_images() -> Result<HelperImages> {
    let root = repo_root();
    // One build at a time: tests that start at once wait for the first, then find its
    // layers cached (two builds of one image at once would both run every step).
    std::fs::create_dir_all(root.join("target"))?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(root.join("target/helper-images.lock"))
        .context("open target/helper-images.lock")?;
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| anyhow::anyhow!("lock target/helper-images.lock: {e}"))?;
    let bases = run(
        Command::new(root.join("deploy/docker/bases")).stderr(Stdio::inherit()),
        "deploy/docker/bases",
    )?;
    let base = |key: &str| -> Result<String> {
        bases
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{key}=")))
            .map(str::to_string)
            .with_context(|| format!("deploy/docker/bases printed no {key}"))
    };
    let (cc, slim) = (base("CC_BASE")?, base("SLIM_BASE")?);
    let context = tempfile::tempdir()?;
    let recipe_dir = root.join("testkit/containers");
    for file in ["Dockerfile", "postgres-entrypoint"] {
        std::fs::copy(recipe_dir.join(file), context.path().join(file))
            .with_context(|| format!("copy testkit/containers/{file}"))?;
    }
    std::fs::copy(
        crate::bin_path("model-standin"),
        context.path().join("model-standin"),
    )
    .context("copy the model-standin binary (cargo build --workspace --bins)")?;
    let wheels = context.path().join("s3-wheels");
    std::fs::create_dir(&wheels)?;
    for wheel in std::fs::read_dir(s3_wheels()?)? {
        let wheel = wheel?;
        if wheel.file_name().to_string_lossy().ends_with(".whl") {
            std::fs::copy(wheel.path(), wheels.join(wheel.file_name()))?;
        }
    }
    let images = HelperImages {
        postgres: "agentlog-test/postgres:test".into(),
        model_standin: "agentlog-test/model-standin:test".into(),
        s3: "agentlog-test/s3:test".into(),
    };
    let context_dir = context.path().to_str().context("a UTF-8 temp dir")?;
    for (target, name) in [
        ("postgres", &images.postgres),
        ("model-standin", &images.model_standin),
        ("s3", &images.s3),
    ] {
        let replaced = docker(&["image", "inspect", "--format", "{{.Id}}", name]).ok();
        run(
            Command::new("docker")
                .env("DOCKER_BUILDKIT", "0")
                .args(["build", "--quiet", "--target", target])
                .args(["--build-arg", &format!("CC_BASE={cc}")])
                .args(["--build-arg", &format!("SLIM_BASE={slim}")])
                .args(["-t", name, context_dir]),
            &format!("docker build --target {target} (testkit/containers/Dockerfile)"),
        )?;
        let built = docker(&["image", "inspect", "--format", "{{.Id}}", name])?;
        if let Some(old) = replaced.filter(|old| *old != built) {
            // In use by a container of another run, it stays.
            let _ = docker(&["rmi", &old]);
        }
    }
    Ok(images)
}
