"""The yardstick's default evaluation text, installed from PyPI.

The Lee corpus (Lee, Pincombe & Welsh, "An empirical evaluation of models of
text document similarity", CogSci 2005): 300 short Australian Broadcasting
Corporation news articles, about 60,000 words (~75,000 SmolLM2 tokens) of
natural English. It is distributed inside the gensim wheel
(``gensim/test/test_data/lee_background.cor``, gensim 4.4.0, LGPL-2.1; the
articles keep their original copyright and are used here for evaluation
only, not redistributed: the set-up downloads the wheel and extracts the one
file into the cache). Newlines separate articles.

    python -m vllm_lowbit_kv.corpus   # download once (pip), print the path
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .model import cache_root

GENSIM_PIN = "gensim==4.4.0"
MEMBERS = {
    "lee_background.txt": "gensim/test/test_data/lee_background.cor",  # evaluation text
    "lee.txt": "gensim/test/test_data/lee.cor",  # held out: calibration, never evaluation
}
LICENSE = "Lee corpus (ABC news, 2005) via gensim 4.4.0 test data, LGPL-2.1 package"


def corpus_path(name: str = "lee_background.txt") -> Path:
    """Path of a corpus file, downloading the gensim wheel once if needed."""
    if name not in MEMBERS:
        raise ValueError(f"corpus name must be one of {sorted(MEMBERS)}, got {name!r}")
    folder = cache_root() / "corpus"
    path = folder / name
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.11", "-d", tmp, GENSIM_PIN],
                       check=True)
        (wheel,) = Path(tmp).glob("gensim-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            for out, member in MEMBERS.items():
                (folder / out).write_bytes(zf.read(member))
    return path


def default_text() -> str:
    return corpus_path().read_text(encoding="utf-8")


def calibration_text() -> str:
    # lee.cor is Latin-1, not UTF-8: one byte 0xA3 ("£3,000"); the rest is ASCII
    return corpus_path("lee.txt").read_text(encoding="latin-1")


if __name__ == "__main__":
    print(corpus_path())
