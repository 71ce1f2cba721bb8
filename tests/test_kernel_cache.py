"""The on-disk kernel cache: one program per kernel, shared between processes under a lock, reported when
slow, usable read-only; ``warmup``'s arguments. CPU only (NVRTC compiles without a GPU)."""
import logging
import os
import subprocess
import sys

import pytest

import moe_rt  # noqa: F401 - registers the kernels
from moe_rt import _jit

try:
    from cupy.cuda import nvrtc

    nvrtc.getVersion()
    _jit.cuda_include_dir()
    HAVE_NVRTC = True
except Exception:  # noqa: BLE001
    HAVE_NVRTC = False

needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="NVRTC or CUDA headers not installed")
SMALL = ("common.cu", "fill_bytes")  # a kernel that compiles in well under a second


@needs_nvrtc
def test_two_processes_on_an_empty_cache_compile_once(tmp_path):
    """Started together on an empty folder, two processes produce one compile (the other waits on the lock
    and loads it) and the same image."""
    code = ("import sys, hashlib; from moe_rt import _jit\n"
            "img, low, compiled = _jit.kernel_image('router.cu', 'router_fwd<float, 128>', 'sm_90', root=sys.argv[1])\n"
            "print(int(compiled), hashlib.sha1(img).hexdigest(), low)\n")
    env = dict(os.environ, MOE_RT_QUIET="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    rows = [o[0].split() for o in outs]
    assert sorted(int(r[0]) for r in rows) == [0, 1], rows
    assert rows[0][1:] == rows[1][1:]
    images = list((tmp_path / "sm_90").glob("*.cubin"))
    assert len(images) == 1 and images[0].with_suffix(".json").is_file()
    assert not list((tmp_path / "sm_90").glob("*.tmp"))


@needs_nvrtc
def test_cached_entry_is_served_and_a_broken_one_recompiled(tmp_path):
    img, low, compiled = _jit.kernel_image(*SMALL, "sm_90", root=str(tmp_path))
    assert compiled and img[:4] == b"\x7fELF" and low
    again = _jit.kernel_image(*SMALL, "sm_90", root=str(tmp_path))
    assert again == (img, low, False)
    entry = _jit._entry(str(tmp_path), *SMALL, "sm_90")
    entry.with_suffix(".json").write_text("{not json")  # a damaged entry is compiled again, not trusted
    assert _jit.kernel_image(*SMALL, "sm_90", root=str(tmp_path))[2]
    assert _jit.kernel_image(*SMALL, "sm_90", root=str(tmp_path))[2] is False


@needs_nvrtc
def test_ptx_for_an_architecture_without_machine_code(tmp_path):
    img, low, _ = _jit.kernel_image(*SMALL, "compute_90", root=str(tmp_path))
    assert b".entry" in img and low.encode() in img
    assert _jit._entry(str(tmp_path), *SMALL, "compute_90").suffix == ".ptx"


@needs_nvrtc
def test_slow_compiles_are_said_unless_quiet(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_jit, "_SLOW_COMPILE_S", -1.0)
    monkeypatch.delenv("MOE_RT_QUIET", raising=False)
    _jit.kernel_image(*SMALL, "sm_90", root=str(tmp_path / "a"))
    err = capsys.readouterr().err
    assert "moe_rt: compiled fill_bytes (common.cu) for sm_90 in" in err and err.count("\n") == 1
    monkeypatch.setenv("MOE_RT_QUIET", "1")
    _jit.kernel_image(*SMALL, "sm_90", root=str(tmp_path / "b"))
    assert capsys.readouterr().err == ""


def test_messages_follow_the_moe_rt_logger(monkeypatch, capsys, caplog):
    monkeypatch.delenv("MOE_RT_QUIET", raising=False)
    log = logging.getLogger("moe_rt")
    monkeypatch.setattr(log, "level", logging.NOTSET)
    _jit.say("plain line")
    assert capsys.readouterr().err == "plain line\n"
    monkeypatch.setattr(log, "level", logging.WARNING)  # the program silenced moe_rt's INFO lines
    with caplog.at_level(logging.WARNING, logger="moe_rt"):
        _jit.say("hidden line")
    assert "hidden line" not in caplog.text and capsys.readouterr().err == ""
    with caplog.at_level(logging.INFO, logger="moe_rt"):
        _jit.say("logged line")
    assert "logged line" in caplog.text and capsys.readouterr().err == ""


@needs_nvrtc
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_cache_is_said_once_and_kernels_still_compile(tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.delenv("MOE_RT_QUIET", raising=False)
    monkeypatch.setattr(_jit, "_unwritable", set())
    try:
        assert _jit.kernel_image(*SMALL, "sm_90", root=str(ro))[2]
        assert _jit.kernel_image(*SMALL, "sm_90", root=str(ro))[2]
    finally:
        ro.chmod(0o755)
    err = capsys.readouterr().err
    assert err.count("cannot be written") == 1


@needs_nvrtc
def test_an_unwritable_cache_as_root(tmp_path, monkeypatch, capsys):
    """A cache path under a regular file cannot be created, whoever runs the test."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.delenv("MOE_RT_QUIET", raising=False)
    monkeypatch.setattr(_jit, "_unwritable", set())
    assert _jit.kernel_image(*SMALL, "sm_90", root=str(blocker / "cache"))[2]
    assert _jit.kernel_image(*SMALL, "sm_90", root=str(blocker / "cache"))[2]
    assert capsys.readouterr().err.count("cannot be written") == 1


@needs_nvrtc
def test_arch_choice(monkeypatch):
    monkeypatch.setattr(_jit, "_supported_archs", lambda: (75, 80, 86, 89, 90))
    assert _jit.arch_for((9, 0)) == "sm_90"
    assert _jit.arch_for((8, 0)) == "sm_80"
    assert _jit.arch_for((10, 0)) == "compute_90"  # newer than NVRTC knows: PTX, compiled by the driver
    with pytest.raises(RuntimeError, match="cannot compile for sm_70"):
        _jit.arch_for((7, 0))
    assert _jit.check_arch("sm_90") == "sm_90" and _jit.check_arch("compute_80") == "compute_80"
    for bad in ("sm90", "90", "", "sm_91"):
        with pytest.raises(ValueError, match="arch"):
            _jit.check_arch(bad)


def _warmup(*args, env=None):
    return subprocess.run([sys.executable, "-m", "moe_rt", "warmup", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_warmup_rejects_bad_arguments(tmp_path):
    for args, msg in ((["--jobs", "0"], "--jobs must be >= 1"), (["--arch", ","], "name at least one"),
                      (["--arch", "sm90", "--out", str(tmp_path)], "expected a name like sm_90")):
        r = _warmup(*args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_warmup_without_a_gpu_asks_for_arch():
    from conftest import GPU_COUNT

    if GPU_COUNT:
        pytest.skip("a GPU is present")
    r = _warmup()
    assert r.returncode == 2 and "no CUDA GPU found" in r.stderr and "--arch" in r.stderr
    assert "Traceback" not in r.stderr


def test_warmup_help():
    r = _warmup("--help")
    assert r.returncode == 0 and "MOE_RT_KERNEL_CACHE" in r.stdout and "--arch" in r.stdout


def test_cache_folder_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path / "k"))
    assert _jit.cache_dir() == str(tmp_path / "k")
    monkeypatch.delenv("MOE_RT_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _jit.cache_dir() == str(tmp_path / "xdg" / "moe_rt" / "kernels")


def test_extra_nvrtc_options_get_a_cache_folder_of_their_own(monkeypatch, tmp_path):
    """The C core loads what its folder's manifest lists by (file, name, architecture): builds with other
    MOE_RT_NVRTC_OPTIONS must not share that folder, or a process would run another option set's kernels."""
    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path / "k"))
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
    plain = _jit.cache_dir()
    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "-lineinfo")
    lineinfo = _jit.cache_dir()
    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "  -lineinfo ")
    assert _jit.cache_dir() == lineinfo  # the same options, split at white space
    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "-DMOE_RT_SELR_MINB_BITMAP_F32=10")
    other = _jit.cache_dir()
    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "")
    assert _jit.cache_dir() == plain == str(tmp_path / "k")
    assert len({plain, lineinfo, other}) == 3
    for d in (lineinfo, other):
        assert os.path.dirname(d) == plain and os.path.basename(d).startswith("nvrtc-")


@needs_nvrtc
def test_a_manifest_of_other_nvrtc_options_is_replaced(monkeypatch, tmp_path):
    """add_to_manifest merges only into a manifest of the same sources and options: rows listed under
    other options are dropped, not served."""
    import json

    root = str(tmp_path)
    monkeypatch.setenv("MOE_RT_QUIET", "1")
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
    _jit.cache_kernels(root, [SMALL], "sm_90")
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["options"] == [] and [r["name"] for r in m["kernels"]] == [SMALL[1]]
    plain_image = m["kernels"][0]["image"]
    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "-lineinfo")
    _jit.cache_kernels(root, [SMALL], "sm_90")
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["options"] == ["-lineinfo"] and len(m["kernels"]) == 1
    assert m["kernels"][0]["image"] != plain_image  # the -lineinfo build, not the plain one



@needs_nvrtc
def test_a_manifest_of_another_nvrtc_is_replaced(monkeypatch, tmp_path):
    """After an NVRTC upgrade the kernels compile again (the version is in their keys), and the manifest the
    C core loads by (file, name, arch) must list the new builds, not keep the older NVRTC's rows."""
    import json

    root = str(tmp_path)
    monkeypatch.setenv("MOE_RT_QUIET", "1")
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
    _jit.cache_kernels(root, [SMALL], "sm_90")
    old = json.loads((tmp_path / "manifest.json").read_text())["kernels"][0]["image"]
    real = _jit.nvrtc_version()
    monkeypatch.setattr(_jit, "nvrtc_version", lambda: (real[0], real[1] + 100))
    _jit.cache_kernels(root, [SMALL], "sm_90")
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["nvrtc"] == f"{real[0]}.{real[1] + 100}" and len(m["kernels"]) == 1
    assert m["kernels"][0]["image"] != old
    assert m["kernels"][0]["image"] == str(_jit._entry(root, *SMALL, "sm_90").relative_to(root))


@pytest.mark.parametrize("var, bad", [("MOE_RT_TIERED", ("false", "off", "2")), ("MOE_RT_LAUNCH", ("CuPy", "drv")),
                                      ("MOE_RT_ROUTER_FWD", ("Generic", "reg")), ("MOE_RT_ROUTER_TEAM", ("64", "x")),
                                      ("MOE_RT_ROUTER_TPW", ("f", "1,x", "-1")),
                                      ("MOE_RT_QB_SMEM_HIST_BYTES", ("48k", "-1", "1,2")),
                                      ("MOE_RT_QB_REG_WARPS", ("four", "1.5")),
                                      ("MOE_RT_PLAN_FUSED_SLOTS", ("4k", "-1", "1,2")),
                                      ("MOE_RT_PLAN_FUSED_MAP_SLOTS", ("8k", "-1")),
                                      ("MOE_RT_GATHER_ROWS", ("4k", "-1", "1,2")),
                                      ("MOE_RT_GATHER_X_BYTES", ("16M", "-1"))])
def test_switches_reject_values_they_do_not_know(var, bad):
    """The switches read at import take their documented values or none: MOE_RT_TIERED=false ran the
    stand-ins (only "0" turned them off), a misspelt MOE_RT_LAUNCH the driver launcher, MOE_RT_ROUTER_FWD /
    MOE_RT_ROUTER_TEAM values they do not know the default kernels, silently; the integer ones failed the
    import with int()'s message, which names no variable."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for v in bad:
        r = subprocess.run([sys.executable, "-c", "import moe_rt.router"], env=dict(os.environ, **{var: v}),
                           capture_output=True, text=True, cwd=root)
        assert r.returncode != 0 and f"ValueError: {var}: expected" in r.stderr and repr(v) in r.stderr, r.stderr


def test_switch_parsers(monkeypatch):
    monkeypatch.setenv("X_SWITCH", "")
    assert _jit.env_choice("X_SWITCH", ("0", "1"), "1") == "1" and _jit.env_choice("X_SWITCH", ("a",), None) is None
    monkeypatch.setenv("X_SWITCH", "0")
    assert _jit.env_choice("X_SWITCH", ("0", "1"), "1") == "0"
    assert _jit.env_ints("X_SWITCH", 7, one=True) == 0 and _jit.env_ints("X_SWITCH", None) == (0,)
    monkeypatch.setenv("X_SWITCH", "2,0")
    assert _jit.env_ints("X_SWITCH", None) == (2, 0)
    with pytest.raises(ValueError, match="X_SWITCH: expected an integer >= 0, got '2,0'"):
        _jit.env_ints("X_SWITCH", 7, one=True)
    monkeypatch.delenv("X_SWITCH")
    assert _jit.env_ints("X_SWITCH", 7, one=True) == 7


def test_function_raises_where_the_folder_changed_after_kernels_were_loaded(monkeypatch, tmp_path):
    """_jit.function keeps the kernels it loaded by (file, name, device): a kernel first loaded after
    MOE_RT_NVRTC_OPTIONS or MOE_RT_KERNEL_CACHE changed would come from another folder than those already
    running; it raises RuntimeError naming the variables instead, and loads again once the change is undone.
    (A stand-in CuPy module and kernel_image: no GPU.)"""
    import types

    loaded = []

    class Module:
        def load(self, image):
            loaded.append(image)

        def get_function(self, name):
            return types.SimpleNamespace(ptr=len(loaded))

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0),
                                      function=types.SimpleNamespace(Module=Module))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_jit, "_functions", {})
    monkeypatch.setattr(_jit, "_functions_root", None, raising=False)
    monkeypatch.setattr(_jit, "device_properties", lambda dev: {"cc": (9, 0)})
    monkeypatch.setattr(_jit, "kernel_image", lambda file, name, arch, root=None, where="":
                        (f"{root or _jit.cache_dir()}|{name}".encode(), name, False))
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path / "k"))
    names = _jit.REGISTRY["common.cu"][:2]
    assert len(names) == 2
    first = _jit.function("common.cu", names[0])
    assert loaded == [f"{tmp_path / 'k'}|{names[0]}".encode()]
    for var, value in (("MOE_RT_NVRTC_OPTIONS", "-lineinfo"), ("MOE_RT_KERNEL_CACHE", str(tmp_path / "other"))):
        monkeypatch.setenv(var, value)
        with pytest.raises(RuntimeError, match="MOE_RT_NVRTC_OPTIONS / MOE_RT_KERNEL_CACHE before the first op"):
            _jit.function("common.cu", names[1])
        assert _jit.function("common.cu", names[0]) is first and len(loaded) == 1
        monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
        monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path / "k"))
    _jit.function("common.cu", names[1])
    assert loaded[1] == f"{tmp_path / 'k'}|{names[1]}".encode()
