"""Building the sandbox image from the top-level Containerfile (`coderunner setup --backend ...`).

The image is labelled with a digest of what went into it (Containerfile, sandbox requirements,
guest package, entrypoint), so setup skips a build that is already current and the backends can
tell when an image is older than the server's sources.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coderunner.sandbox.apple_version import SECRET_VERSION, ContainerVersion
from coderunner.sandbox.engine import BUILD_TIMEOUT_S, QUERY_TIMEOUT_S, EngineError, engine_env, run_sync
from coderunner.sandbox.env import SetupError
from coderunner.vocabulary.backends import Setup, entry

if TYPE_CHECKING:
    from coderunner.config import Settings

#: The source checkout the Containerfile lives in (setup builds from a clone, as install.sh does).
REPO = Path(__file__).resolve().parents[3]
LABEL_SOURCES = "coderunner.sources"
#: TLS roots handed to pip in the build as a secret, for networks that intercept TLS: public
#: certificates only, mounted for one RUN step and never stored in a layer. SSL_CERT_FILE, when
#: set, is used instead (the way to add a root the system files lack, e.g. on a Mac, where
#: /etc/ssl/cert.pem holds the system roots but not ones added to the keychain).
CA_BUNDLES = (
    Path("/etc/ssl/certs/ca-certificates.crt"),
    Path("/etc/pki/tls/certs/ca-bundle.crt"),
    Path("/etc/ssl/cert.pem"),
)
#: A Mac's roots, keychain-added ones included, as one PEM file for SSL_CERT_FILE.
MAC_EXPORT_ROOTS = (
    "security find-certificate -a -p /System/Library/Keychains/SystemRootCertificates.keychain "
    "/Library/Keychains/System.keychain > ~/coderunner-roots.pem"
)


class ImageError(SetupError):
    """The image could not be built; the message names the failing command."""


def source_files(repo: Path = REPO) -> list[Path]:
    guest = repo / "src" / "coderunner" / "guest"
    return [
        repo / "Containerfile",
        repo / "src" / "coderunner" / "sandbox" / "requirements.txt",
        repo / "containers" / "coderunner-kernel",
        *sorted(path for pattern in ("*.py", "*.cjs") for path in guest.glob(pattern)),
    ]


def sources_digest(repo: Path = REPO) -> str:
    digest = hashlib.sha256()
    for path in source_files(repo):
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def default_ca_bundle() -> Path | None:
    env = os.environ.get("SSL_CERT_FILE")
    for candidate in [Path(env)] if env else list(CA_BUNDLES):
        if candidate.is_file():
            return candidate
    return None


def _ulimit(kind: int, cap: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


@dataclass(frozen=True)
class BuildCommand:
    """The exact build argv for podman, docker or Apple `container`; pure, so unit-testable."""

    kind: str
    engine: str
    image: str
    context: Path
    digest: str
    base_image: str | None = None
    runtime: str | None = None
    ca_bundle: Path | None = None
    #: Apple `container`'s release (from `container --version`): `build --secret` needs 0.11.0.
    apple_version: ContainerVersion | None = None
    nofile: int = 4096
    nproc: int = 4096

    def argv(self) -> list[str]:
        containerfile = str(self.context / "Containerfile")
        build_args = ["--build-arg", f"BASE_IMAGE={self.base_image}"] if self.base_image else []
        if self.kind == "apple":
            secret = ["--secret", f"id=ca_bundle,src={self.ca_bundle}"] if self.apple_secret else []
            return [self.engine, "build", "--tag", self.image, "--file", containerfile, *build_args,
                    "--label", f"{LABEL_SOURCES}={self.digest}", *secret, str(self.context)]  # fmt: skip
        args = [self.engine]
        if self.kind == "podman" and self.runtime:
            args += ["--runtime", self.runtime]
        args += ["build", "--tag", self.image, "--file", containerfile, *build_args,
                 "--label", f"{LABEL_SOURCES}={self.digest}",
                 "--ulimit", f"nofile={self.nofile}:{self.nofile}"]  # fmt: skip
        if self.kind == "podman":
            args += ["--ulimit", f"nproc={self.nproc}:{self.nproc}"]
        if self.ca_bundle is not None:
            args += ["--secret", f"id=ca_bundle,src={self.ca_bundle}"]
        return [*args, str(self.context)]

    @property
    def apple_secret(self) -> bool:
        """Apple `container` takes the TLS root only from 0.11.0 (an older one refuses `--secret`)."""
        return self.ca_bundle is not None and self.apple_version is not None and self.apple_version.has_build_secret

    def tls_hint(self) -> str:
        """What to do when pip failed with CERTIFICATE_VERIFY_FAILED (a network that intercepts TLS)."""
        if self.kind != "apple":
            return (
                "If pip failed with CERTIFICATE_VERIFY_FAILED, set SSL_CERT_FILE to a PEM file with your network's root"
            )
        if self.apple_version is None or not self.apple_version.has_build_secret:
            return (
                f"If pip failed with CERTIFICATE_VERIFY_FAILED (your network intercepts TLS): Apple container "
                f"{self.apple_version or '(version unknown)'} cannot hand the build a TLS root (`build --secret` needs "
                f"{SECRET_VERSION}): upgrade with ./install.sh, then run setup again"
            )
        given = f"the build got {self.ca_bundle}, without your network's root" if self.ca_bundle else "no roots found"
        return (
            f"If pip failed with CERTIFICATE_VERIFY_FAILED (your network intercepts TLS; {given}): export the "
            f"roots, keychain ones included, with `{MAC_EXPORT_ROOTS}`, then run "
            "`SSL_CERT_FILE=~/coderunner-roots.pem coderunner setup --backend apple`"
        )

    def label_query(self) -> list[str]:
        """The sources label of an existing image (Apple `container` prints JSON instead)."""
        if self.kind == "apple":
            return [self.engine, "image", "inspect", self.image]
        base = [self.engine, "--runtime", self.runtime] if self.kind == "podman" and self.runtime else [self.engine]
        return [*base, "image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL_SOURCES}"}}}}', self.image]


def build_command(settings: Settings, repo: Path = REPO) -> BuildCommand:
    builder = entry(settings.backend).image_builder  # gvisor runs podman's image
    kind = builder.name
    engine = shutil.which(builder.engine or kind)
    if engine is None:
        raise ImageError(f"{kind} engine not found: {builder.install_hint}")
    if not (repo / "Containerfile").is_file():
        raise ImageError(f"no Containerfile in {repo}: build from a source checkout (git clone, then ./install.sh)")
    apple_version = _apple_version(engine) if kind == "apple" else None
    return BuildCommand(
        kind=kind,
        engine=engine,
        image=settings.image,
        context=repo,
        digest=sources_digest(repo),
        base_image=settings.base_image,
        runtime=settings.oci_runtime,
        ca_bundle=default_ca_bundle() if kind == "apple" or sys.platform.startswith("linux") else None,
        apple_version=apple_version,
        nofile=_ulimit(resource.RLIMIT_NOFILE, 4096),
        nproc=_ulimit(resource.RLIMIT_NPROC, 4096),
    )


def _apple_version(engine: str) -> ContainerVersion | None:
    """Which release builds (its options differ); None when `container --version` does not say."""
    try:
        done = run_sync([engine, "--version"], QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ)))
    except EngineError:
        return None
    return ContainerVersion.parse(done.stdout)


def current_digest(command: BuildCommand) -> str | None:
    """The sources digest the existing image was built from, or None (missing, or unlabelled)."""
    try:
        done = run_sync(command.label_query(), QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ)))
    except EngineError:
        return None
    if done.returncode != 0:
        return None
    text = done.stdout.strip()
    if command.kind == "apple":
        return command.digest if command.digest in text else None
    return text or None


def build(settings: Settings, *, recreate: bool = False, repo: Path = REPO) -> str:
    """Build the image unless one from the same sources exists; the build's output goes to stderr."""
    if entry(settings.backend).setup is not Setup.IMAGE:
        raise ImageError(f"the {settings.backend} backend uses no image: run `coderunner setup` without --backend")
    command = build_command(settings, repo)
    if not recreate and current_digest(command) == command.digest:
        print(f"coderunner setup: {command.image} is current ({command.digest})", file=sys.stderr)
        return command.image
    argv = command.argv()
    print(f"coderunner setup: building the sandbox image: {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        subprocess.run(
            argv, check=True, timeout=BUILD_TIMEOUT_S, stdout=sys.stderr, stdin=subprocess.DEVNULL,
            env=engine_env(dict(os.environ)),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ImageError(f"building {command.image} took longer than {BUILD_TIMEOUT_S:g}s") from None
    except subprocess.CalledProcessError as exc:
        raise ImageError(
            f"`{' '.join(argv)}` failed with exit code {exc.returncode} (its output is above). {command.tls_hint()}"
        ) from None
    return command.image
