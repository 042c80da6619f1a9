"""Checks what each extra of pyproject.toml installs on a fresh machine.

Run by the `extras` step of .ci/run from the repository root. For each
extra, pip resolves `.[extra]` as it would on an empty environment
(`--dry-run --ignore-installed --report`: nothing is downloaded beyond
metadata, nothing installed) and this script checks the packages it would
install: the extra brings what its name says, and no backend it does not
name (`[examples]` no TensorFlow on a JAX or PyTorch machine, `[docs]` no
backend at all). torch is pinned to the CPU build this machine serves, as
the README's test command pins it. The `docs` step builds the site in a
fresh venv with `[docs]` alone. Exits non-zero, naming each failed check.
"""

import json
import os
import subprocess
import sys
import tempfile

BACKENDS = {"tensorflow", "jax", "jaxlib", "torch"}
TORCH_PIN = "torch==2.13.0"

# extra -> (packages it must bring, packages it must not bring).
EXPECTED = {
    "tensorflow": ({"tensorflow", "tensorboard", "keras"}, {"jax", "torch"}),
    "jax": ({"jax", "jaxlib", "keras"}, {"tensorflow", "torch"}),
    "torch": ({"torch", "keras"}, {"tensorflow", "jax"}),
    "privacy": ({"dp-accounting"}, BACKENDS),
    "examples": (
        {"absl-py", "scikit-learn", "matplotlib", "dp-accounting"},
        BACKENDS | {"keras-hub"},
    ),
    "hub": ({"keras-hub"}, set()),
    "docs": (
        {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python"},
        BACKENDS,
    ),
    "test": ({"pytest", "pytest-xdist", "absl-py", "dp-accounting"}, BACKENDS),
    "torch-test": ({"opacus", "torch"}, {"tensorflow", "jax"}),
}


def _resolve(extra: str, report: str) -> subprocess.Popen:
    """Starts pip's resolution of `.[extra]`, writing its report."""
    requirements = [f".[{extra}]"]
    if extra in ("torch", "torch-test"):
        requirements.append(TORCH_PIN)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            report,
            *requirements,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _name(item: dict) -> str:
    """A package's normalized name in pip's report."""
    return item["metadata"]["name"].lower().replace("_", "-")


def main() -> int:
    """Resolves every extra at once; prints and returns the verdict."""
    problems = []
    with tempfile.TemporaryDirectory() as scratch:
        running = {}
        for extra in EXPECTED:
            report = os.path.join(scratch, f"{extra}.json")
            running[extra] = (_resolve(extra, report), report)
        for extra, (process, report) in running.items():
            try:
                _, errors = process.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                problems.append(f"[{extra}]: pip took over 600 s")
                continue
            if process.returncode != 0:
                problems.append(f"[{extra}]: pip failed: {errors[-2000:]}")
                continue
            with open(report, encoding="utf-8") as handle:
                names = {_name(item) for item in json.load(handle)["install"]}
            wanted, unwanted = EXPECTED[extra]
            missing = sorted(wanted - names)
            extra_packages = sorted(unwanted & names)
            if missing:
                problems.append(f"[{extra}] does not bring {missing}")
            if extra_packages:
                problems.append(f"[{extra}] brings {extra_packages}")
            print(f"[{extra}]: {len(names)} packages, checked")
    for problem in problems:
        print(f"check_extras: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
