"""The docs against the code, on the CPU: environment variables, cited file paths, command-line options.

- Every ``MOE_RT_*`` variable that README.md or docs/*.md name is read by the code (moe_rt/, csrc/, tools/),
  and every variable the code reads is named there, unless it is one of ``NOT_DOCUMENTED`` (benchmark, test
  and script knobs, each with its reason).
- Every path under tools/, tests/, kernels/, csrc/, docs/, include/, moe_rt/ or examples/ that README.md,
  BENCHMARKS.md, docs/*.md or a module docstring of moe_rt/ or tools/ cites exists (a build output, ignored
  by git, counts when git ignores it).
- Every ``--option`` that README.md, BENCHMARKS.md or docs/*.md show appears in the ``--help`` of
  ``python3 -m moe_rt`` (its commands and bench targets) or of a tools/*.py script, or is pip's / setup.py's.
"""
from __future__ import annotations

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
VAR = r"MOE_RT_[A-Z0-9_]+"

# Read by the code, deliberately not in README.md / docs: kernel-variant and tuning switches for benchmarks
# and tests, internals of the demo and of the GPU scripts.
NOT_DOCUMENTED = {
    "MOE_RT_LAUNCH": "launch through CuPy instead of the driver: a test and benchmark switch (moe_rt/_jit.py)",
    "MOE_RT_ROUTER_FWD": "a QB forward kernel variant for benchmarks and tests (moe_rt/router.py)",
    "MOE_RT_ROUTER_TEAM": "a QB forward kernel variant for benchmarks and tests (moe_rt/router.py)",
    "MOE_RT_ROUTER_TPW": "tokens per warp of the QB forward: a benchmark variant (moe_rt/router.py)",
    "MOE_RT_QB_SMEM_HIST_BYTES": "the QB shared-histogram limit: a benchmark and test variant (moe_rt/router.py)",
    "MOE_RT_QB_REG_WARPS": "warps per block of router_fwd_qb_reg: a benchmark variant (moe_rt/router.py)",
    "MOE_RT_LIBCUDA": "the driver library's name, for tools/profile_core_calls.py's stub driver (csrc/context.c)",
    "MOE_RT_DEMO_EP_CPU": "the EP demo's one-rank CPU run, for its test (moe_rt/demo_ep.py)",
    "MOE_RT_COORDINATOR": "set by the EP demo for the ranks it starts (moe_rt/demo_ep.py)",
    "MOE_RT_BENCH_EP_NPROC": "bench_ep's default rank count, shown in its --help (moe_rt/bench/ep.py)",
    "MOE_RT_COMMIT": "the commit the benchmark tables record (moe_rt/bench/_lib.py, tools/gpu_lib.sh)",
    "MOE_RT_BENCH": "tools/gpu_check.sh's benchmark selection, described in the script",
    "MOE_RT_BENCH_ARGS": "tools/gpu_check.sh's benchmark arguments, described in the script",
    "MOE_RT_SKIP_BENCH": "tools/ep_gpu_run.sh's switch",
}

_READS = [
    re.compile(r"os\.environ(?:\.get)?\s*[\[(]\s*[\"'](" + VAR + r")[\"']"),  # os.environ["X"], .get("X")
    re.compile(r"\bgetenv\s*\(\s*\"(" + VAR + r")\""),  # C and os.getenv
    re.compile(r"_env_number\s*\(\s*[\"'](" + VAR + r")[\"']"),  # moe_rt/ep.py's parser
    re.compile(r"env_(?:choice|ints)\s*\(\s*[\"'](" + VAR + r")[\"']"),  # moe_rt/_jit.py's parsers
    re.compile(r"\$\{(" + VAR + r")"),  # shell
]


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _code_files() -> list[str]:
    pats = ["moe_rt/**/*.py", "moe_rt/*.pyx", "csrc/*.c", "csrc/*.h", "kernels/*.cu", "tools/*.py", "tools/*.sh"]
    out = []
    for p in pats:
        out += glob.glob(os.path.join(ROOT, p), recursive=True)
    return sorted(os.path.relpath(p, ROOT) for p in out)


def env_vars_read() -> dict[str, str]:
    """Each MOE_RT_* environment variable the code reads, with the first file that reads it."""
    out: dict[str, str] = {}
    for path in _code_files():
        text = _read(path)
        for pat in _READS:
            for m in pat.finditer(text):
                out.setdefault(m.group(1), path)
    return out


def env_vars_documented() -> dict[str, str]:
    out: dict[str, str] = {}
    for doc in DOCS:
        for m in re.finditer(r"(?<!-D)" + VAR, _read(doc)):  # -DMOE_RT_X: a kernel macro, not a variable
            out.setdefault(m.group(0), doc)
    return out


def test_env_var_reader_finds_known_reads():
    read = env_vars_read()
    for name in ("MOE_RT_KERNEL_CACHE", "MOE_RT_EP_TIMEOUT", "MOE_RT_NCCL_PATH", "MOE_RT_LIBCUDA", "MOE_RT_BENCH"):
        assert name in read, name


def test_documented_env_vars_are_read():
    read = env_vars_read()
    stale = {name: doc for name, doc in env_vars_documented().items() if name not in read}
    assert not stale, f"named in the docs, read by no code: {stale}"


def test_read_env_vars_are_documented():
    documented = env_vars_documented()
    missing = {name: path for name, path in env_vars_read().items()
               if name not in documented and name not in NOT_DOCUMENTED}
    assert not missing, f"read by the code, named in no doc (README.md, docs/*.md): {missing}"


def test_not_documented_list_is_current():
    read = env_vars_read()
    gone = sorted(name for name in NOT_DOCUMENTED if name not in read)
    assert not gone, f"NOT_DOCUMENTED names variables nothing reads: {gone}"
    both = sorted(name for name in NOT_DOCUMENTED if name in env_vars_documented())
    assert not both, f"NOT_DOCUMENTED names documented variables: {both}"


# -- cited paths ---------------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w/.-])((?:tools|tests|kernels|csrc|docs|include|moe_rt|examples)/[\w./*-]*[\w*])")


def _cited_texts():
    for doc in DOCS + ["BENCHMARKS.md"]:
        yield doc, _read(doc)
    for path in sorted(glob.glob(os.path.join(ROOT, "moe_rt", "*.py")) + glob.glob(os.path.join(ROOT, "tools", "*.py"))):
        rel = os.path.relpath(path, ROOT)
        yield rel + " (docstring)", ast.get_docstring(ast.parse(_read(rel))) or ""


def _ignored(path: str) -> bool:
    r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True)
    return r.returncode == 0


def test_cited_paths_exist():
    missing = []
    for where, text in _cited_texts():
        for line_no, line in enumerate(text.splitlines(), 1):
            for m in PATH.finditer(line):
                path = m.group(1).rstrip(".")
                if "*" in path:
                    ok = bool(glob.glob(os.path.join(ROOT, path)))
                else:
                    ok = os.path.exists(os.path.join(ROOT, path)) or _ignored(path)
                if not ok:
                    missing.append(f"{where}:{line_no}: {path}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


# -- command-line options ------------------------------------------------------------------------------

OPTION = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*)")
OTHER_TOOLS = {"--no-deps", "--no-build-isolation", "--inplace",  # pip install, setup.py build_ext
               "--clock-control",  # ncu (Nsight Compute), as BENCHMARKS.md's profiles ran it
               "--xla_gpu_enable_command_buffer", "--xla_gpu_graph_min_graph_size"}  # XLA's own, in XLA_FLAGS


def _help(args: list[str]) -> str:
    r = subprocess.run([sys.executable] + args + ["--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, f"{' '.join(args)} --help failed: {r.stderr[-2000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def known_options() -> set[str]:
    cmds = [["-m", "moe_rt"]] + [["-m", "moe_rt", c] for c in ("info", "demo", "warmup", "bench")]
    cmds += [["-m", "moe_rt", "bench", b] for b in ("router", "permutation", "fp8", "ep", "layer")]
    cmds += [[os.path.relpath(p, ROOT)] for p in sorted(glob.glob(os.path.join(ROOT, "tools", "*.py")))]
    out = set(OTHER_TOOLS)
    for args in cmds:
        out |= set(OPTION.findall(_help(args)))
    return out


def test_doc_options_exist(known_options):
    unknown = []
    for doc in DOCS + ["BENCHMARKS.md"]:
        for line_no, line in enumerate(_read(doc).splitlines(), 1):
            unknown += [f"{doc}:{line_no}: {o}" for o in OPTION.findall(line) if o not in known_options]
    assert not unknown, "options that no --help lists:\n" + "\n".join(unknown)
