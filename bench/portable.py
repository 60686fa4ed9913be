"""Results that name no path of the machine that made them.

Every JSON and Markdown file under ``bench/results/`` records the command that
made it. Written as run, such a command holds the virtual environment's python,
the model's cache folder under the user's home, log folders under /tmp: paths
that tell a reader nothing and leak a directory layout. The benchmark writers
pass their commands and model names through :func:`portable`:

* the running python (``sys.executable``) becomes ``python``;
* a model folder becomes its served name (the embedded model's
  ``SmolLM2-135M-Instruct``); ``--model`` of the embedded model is left out
  of a command (``python -m serving`` serves it by default);
* a path inside this repository becomes relative to it, one in the project's
  cache (codebooks) ``$VLLM_LOWBIT_KV_CACHE/...``;
* any other absolute path becomes ``$TMPDIR/...`` (under the temporary
  folder), ``$HOME/...`` (under the home folder) or ``$DIR/<last part>``.

:func:`absolute_paths` finds what is left (the test over ``bench/results/``
uses it); ``python -m bench.portable [--fix] FILE...`` lists, or rewrites, the
absolute paths of result files (values stay as measured).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: an absolute path of a machine: a first component that names a system folder
#: (not preceded by a word character, '$' or '~', so "$HOME/x", "a/b" and URLs' hosts
#: are not), or anything inside a site-packages / dist-packages folder
_ABSOLUTE = re.compile(
    r"(?<![\w$~.:/-])/(?:root|home|tmp|work|usr|opt|var|mnt|srv|etc|private|Users|scratch|data)"
    r"(?:/[^\s\"'`,;)\]}]*)?"
    r"|[^\s\"'`]*(?:site|dist)-packages[^\s\"'`]*")


def absolute_paths(text: str) -> list[str]:
    """The absolute paths in ``text`` (empty: portable)."""
    return [m.group(0) for m in _ABSOLUTE.finditer(text)]


def _embedded_model() -> str:
    from vllm_lowbit_kv.model import MODEL_NAME, cache_root

    return str(cache_root() / MODEL_NAME)


def _served_name(model: str) -> str:
    return Path(model).name


def _prefixes(models: Iterable[str | os.PathLike]) -> list[tuple[str, str]]:
    """(absolute prefix, replacement), longest first."""
    pairs = [(str(Path(m)), _served_name(str(m))) for m in models if m and os.path.isabs(str(m))]
    pairs += [(sys.executable, "python"), (str(Path(sys.executable).resolve()), "python")]
    pairs += [(str(ROOT) + os.sep, ""), (str(ROOT), ".")]
    from vllm_lowbit_kv.model import cache_root

    pairs += [(str(cache_root()), "$VLLM_LOWBIT_KV_CACHE")]
    tmp = str(Path(tempfile.gettempdir()))
    pairs += [(tmp, "$TMPDIR")]
    if tmp != "/tmp":
        pairs += [("/tmp", "$TMPDIR")]
    pairs += [(str(Path.home()), "$HOME")]
    return sorted({p: r for p, r in pairs if p and p != os.sep}.items(), key=lambda pr: -len(pr[0]))


def portable(text: str, models: Iterable[str | os.PathLike] = ()) -> str:
    """``text`` (a command, a model, a path) with this machine's absolute paths rewritten
    (module docstring); ``models``: model folders, written as their served names."""
    models = [str(m) for m in models]
    embedded = _embedded_model()
    if embedded in models:  # python -m serving serves it without --model
        text = re.sub(r"\s--model[ =]" + re.escape(embedded) + r"(?=$|[\s\"'])", "", text)
    for prefix, repl in _prefixes(models):
        end = "" if prefix.endswith(os.sep) else r"(?=$|[/\s\"'`,;)\]}])"
        text = re.sub(re.escape(prefix) + end, lambda _m, r=repl: r, text)
    # anything else absolute: keep its last part only
    return _ABSOLUTE.sub(lambda m: "$DIR/" + Path(m.group(0).rstrip("/")).name
                         if m.group(0).rstrip("/") else m.group(0), text)


def command(argv: Sequence[str], models: Iterable[str | os.PathLike] = ()) -> str:
    """A shell command line (shlex-quoted) with its paths made portable."""
    return portable(shlex.join([str(a) for a in argv]), models)


def model_name(model: str | os.PathLike) -> str:
    """What a result calls a model: a local folder by its served name, a hub id as is."""
    model = str(model)
    return _served_name(model) if os.path.isabs(model) else model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.portable", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--fix", action="store_true", help="rewrite the files in place")
    p.add_argument("--model", action="append", default=[],
                   help="a model folder named in the files (served name: its last part)")
    args = p.parse_args(argv)
    left = 0
    for f in args.files:
        text = f.read_text()
        if args.fix:
            models = args.model or re.findall(r"[^\s\"']*/\.cache/vllm-lowbit-kv/[\w.-]+(?=[\s\"'/]|$)",
                                              text)
            # codebook files and other cache entries: the model's part stays a name
            fixed = portable(text, [m for m in models if not m.endswith("codebooks")])
            if fixed != text:
                f.write_text(fixed)
                text = fixed
        found = absolute_paths(text)
        left += len(found)
        for path in found:
            print(f"{f}: {path}")
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
