"""The README's Python blocks run as written, in order, in one namespace, on the CPU.

Every fenced ```python block of README.md is one test, in file order. A test runs every earlier block that
has not run yet, then its own, so ``-k`` on one block still runs what it builds on. A block whose first line
is ``# needs: gpu`` runs only with a GPU; ``# needs: ranks`` (several processes, one per GPU) is always
skipped; any other ``# needs:`` word is an error. A block that imports an optional framework that is not
installed (torch, jax, cupy; ``moe_rt.torch`` and ``moe_rt.jax`` count as torch and jax) is skipped, and so
is a later block that uses a name such a block binds. A block that raises fails its test and every later one.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import re

import pytest

from conftest import GPU_COUNT

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
NEEDS = ("gpu", "ranks")
OPTIONAL = {"torch": "torch", "jax": "jax", "cupy": "cupy", "moe_rt.torch": "torch", "moe_rt.jax": "jax"}


class Block:
    def __init__(self, code: str, line: int):
        self.code, self.line = code, line  # line: the README line of the block's first code line
        first = code.split("\n", 1)[0].strip()
        m = re.match(r"#\s*needs:\s*(\S+)", first)
        self.need = m.group(1).rstrip(",.;") if m else None
        tree = ast.parse(code, filename=f"README.md:{line}")
        self.modules = set()
        self.binds, self.loads = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.modules.add(a.name)
                    self.binds.add((a.asname or a.name).split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                self.modules.add(node.module)
                self.binds.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Name):
                (self.binds if isinstance(node.ctx, ast.Store) else self.loads).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.binds.add(node.name)

    def missing(self) -> list[str]:
        """The optional frameworks this block imports that are not installed."""
        out = set()
        for mod in self.modules:
            for name, pkg in OPTIONAL.items():
                if (mod == name or mod.startswith(name + ".")) and importlib.util.find_spec(pkg) is None:
                    out.add(pkg)
        return sorted(out)


def blocks_of(text: str) -> list[Block]:
    out = []
    for m in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S):
        out.append(Block(m.group(1), text.count("\n", 0, m.start(1)) + 1))
    return out


def _jax_on_cpu(block: Block):
    """JAX arrays made by the block live on the CPU even where JAX sees a GPU."""
    if not any(m == "jax" or m.startswith("jax.") or m == "moe_rt.jax" for m in block.modules):
        return contextlib.nullcontext()
    import jax

    return jax.default_device(jax.devices("cpu")[0])


class Run:
    """Runs the blocks of one README in order in one namespace; remembers each block's outcome."""

    def __init__(self, blocks: list[Block], gpus: int):
        self.blocks, self.gpus = blocks, gpus
        self.ns: dict = {"__name__": "__readme__"}
        self.done: list = []  # per block run so far: None (ran), ("skip", why) or ("fail", exc)
        self.tainted: set = set()  # names bound by blocks skipped for a missing framework

    def _one(self, b: Block):
        if b.need is not None and b.need not in NEEDS:
            raise ValueError(f"README.md:{b.line}: unknown '# needs: {b.need}' (known: {', '.join(NEEDS)})")
        if b.need == "ranks":
            return ("skip", "needs several processes, one per GPU")
        if b.need == "gpu" and self.gpus < 1:
            return ("skip", "needs a CUDA GPU")
        missing = b.missing()
        if missing:
            self.tainted |= b.binds
            return ("skip", f"needs {', '.join(missing)} (not installed)")
        used = sorted(b.loads & self.tainted)
        if used:
            self.tainted |= b.binds
            return ("skip", f"uses {', '.join(used)} from a block that was skipped")
        # padded so that tracebacks name the README's own line numbers
        code = compile("\n" * (b.line - 1) + b.code, README, "exec")
        with _jax_on_cpu(b):
            exec(code, self.ns)
        return None

    def until(self, i: int):
        """Run blocks up to ``i``; return block ``i``'s outcome. An earlier block's exception is raised."""
        while len(self.done) <= i:
            b = self.blocks[len(self.done)]
            try:
                self.done.append(self._one(b))
            except Exception as e:  # recorded, then raised for this block and every later one
                self.done.append(("fail", e))
        for j in range(i):
            if self.done[j] and self.done[j][0] == "fail":
                raise RuntimeError(f"README block at line {self.blocks[j].line} failed") from self.done[j][1]
        out = self.done[i]
        if out and out[0] == "fail":
            raise out[1]
        return out


with open(README, encoding="utf-8") as _f:
    BLOCKS = blocks_of(_f.read())
_RUN = Run(BLOCKS, GPU_COUNT)


@pytest.fixture(scope="module")
def _device_settings():
    """The README sets the device-wide L2 fetch granularity (a GPU block): put it back for later tests."""
    if GPU_COUNT < 1:
        yield
        return
    import moe_rt

    before = moe_rt.l2_fetch_granularity()
    yield
    if before in (32, 64, 128):  # what the setter accepts (the driver reports what it applied)
        moe_rt.l2_fetch_granularity(before)


@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_block(i, _device_settings):
    out = _RUN.until(i)
    if out is not None:
        pytest.skip(out[1])


def test_readme_has_blocks():
    # the tour: router, dispatch/combine, torch, JAX, expert parallelism (several processes, one process
    # on the CPU, torch autograd)
    assert len(BLOCKS) >= 7
    assert sum(b.need is None for b in BLOCKS) >= 6


def test_runner_fails_on_a_raising_block():
    text = "```python\na = 1\n```\n\n```python\nraise ValueError('boom')\n```\n\n```python\nb = a\n```\n"
    run = Run(blocks_of(text), gpus=0)
    assert run.until(0) is None and run.ns["a"] == 1
    with pytest.raises(ValueError, match="boom"):
        run.until(1)
    with pytest.raises(RuntimeError, match="line 6 failed"):
        run.until(2)


def test_runner_needs_and_missing_frameworks(monkeypatch):
    text = ("```python\n# needs: ranks\nx = 1\n```\n"
            "```python\n# needs: gpu\ny = 1\n```\n"
            "```python\nimport torch\nt = torch.zeros(1)\n```\n"
            "```python\nu = t + 1\n```\n"
            "```python\nv = 2\n```\n"
            "```python\n# needs: tpu\n```\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a))
    run = Run(blocks_of(text), gpus=0)
    assert run.until(0) == ("skip", "needs several processes, one per GPU")
    assert run.until(1) == ("skip", "needs a CUDA GPU")
    assert run.until(2) == ("skip", "needs torch (not installed)")
    assert run.until(3) == ("skip", "uses t from a block that was skipped")
    assert run.until(4) is None and run.ns["v"] == 2 and "x" not in run.ns and "y" not in run.ns
    with pytest.raises(ValueError, match="unknown '# needs: tpu'"):
        run.until(5)
