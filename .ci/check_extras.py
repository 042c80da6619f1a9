"""Checks what each extra of pyproject.toml installs on a fresh machine.

Run by the `extras` step of .ci/run from the repository root. For each
extra, pip resolves `.[extra]` as it would on an empty environment
(`--dry-run --ignore-installed --report`: nothing is downloaded beyond
metadata, nothing installed) and this script checks the packages it would
install: the extra brings what its name says, and no backend it does not
name (`[examples]` no TensorFlow on a JAX or PyTorch machine). torch is
pinned to the CPU build this machine serves, as the README's test command
pins it. The suite step installs the other extras (the README's test
command) and the `docs` step builds the site in a fresh venv with `[docs]`
alone. Exits non-zero, naming each failed check.
"""

import json
import os
import subprocess
import sys
import tempfile

BACKENDS = {"tensorflow", "jax", "jaxlib", "torch"}
TORCH_PIN = "torch==2.13.0"
# Resolutions run at once (each is a pip process; CI has 2 cores).
AT_ONCE = 2

# extra -> (packages it must bring, packages it must not bring). The
# extras the suite step installs together (`tensorflow`, `jax`, `test`,
# `hub`, `torch-test`, `ray`: the README's test command) are proven to
# bring what the tests use by the suite itself, and `docs` by the docs
# step; here, what only a fresh machine shows: a backend extra brings no
# other backend, and the others bring none.
EXPECTED = {
    "jax": ({"jax", "jaxlib", "keras"}, {"tensorflow", "torch"}),
    "torch": ({"torch", "keras"}, {"tensorflow", "jax"}),
    "privacy": ({"dp-accounting"}, BACKENDS),
    "examples": (
        {"absl-py", "scikit-learn", "matplotlib", "dp-accounting"},
        BACKENDS | {"keras-hub"},
    ),
}


def _resolve(extra: str, report: str) -> subprocess.Popen:
    """Starts pip's resolution of `.[extra]`, writing its report."""
    requirements = [f".[{extra}]"]
    if extra == "torch":
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


def _verdict(extra: str, process: subprocess.Popen, report: str) -> list:
    """The problems of one finished resolution."""
    try:
        _, errors = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return [f"[{extra}]: pip took over 600 s"]
    if process.returncode != 0:
        return [f"[{extra}]: pip failed: {errors[-2000:]}"]
    with open(report, encoding="utf-8") as handle:
        names = {_name(item) for item in json.load(handle)["install"]}
    wanted, unwanted = EXPECTED[extra]
    problems = []
    if wanted - names:
        problems.append(f"[{extra}] does not bring {sorted(wanted - names)}")
    if unwanted & names:
        problems.append(f"[{extra}] brings {sorted(unwanted & names)}")
    print(f"[{extra}]: {len(names)} packages, checked")
    return problems


def main() -> int:
    """Resolves the extras, a few at a time; prints and returns the verdict."""
    problems = []
    extras = list(EXPECTED)
    with tempfile.TemporaryDirectory() as scratch:
        while extras:
            batch, extras = extras[:AT_ONCE], extras[AT_ONCE:]
            running = []
            for extra in batch:
                report = os.path.join(scratch, f"{extra}.json")
                running.append((extra, _resolve(extra, report), report))
            for extra, process, report in running:
                problems += _verdict(extra, process, report)
    for problem in problems:
        print(f"check_extras: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
